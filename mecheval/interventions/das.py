"""Distributed alignment search (DAS): in how many dimensions of an activation does the key-value
association live?

For a site at a position (a (B, L, C) site, or a mixer's recurrent state after the position,
flattened) and a subspace size k, DAS learns an orthonormal basis R (C, k) such that swapping
the corrupted document's activation for the clean one's in that subspace,

    patched = corrupted + (clean - corrupted) R R^T,

makes the model give the answer the causal variable says it should after the swap (Geiger et
al. 2024; pyvene's low-rank rotated-space intervention: the first k coordinates of a rotation).
R is trained by gradient descent on the cross-entropy of that answer, the model's weights
frozen; the interchange intervention accuracy (IIA) on held-out documents then says whether k
dimensions carry the variable. At k = C, R R^T = I and the patch is the interchange grid's;
k = 0 rows are the corrupted run unpatched, the level a swap's IIA is measured from.

Counterfactual pairs are the task's, as the grid runs them: the patched run is the corrupted
document's (key or value corrupted), the values swapped in the clean document's; the causal
variable is the value bound to the queried key, so after a swap that carries it the model should
give the clean document's answer.

Batched: every (site, position, k) combination trains at once, each with its own R: per site
and step, one backward over (combinations x documents) rows, each row run from the site's
block on, from the corrupted run's context at a resume point at or before its patch (as the
interchange grid runs its cells), and read out at the query alone; a patch that enters a
recurrent model's last block runs without its recurrence to the query
(mecheval.interventions.das_last_block), and a row whose swap cannot change the query (it
cannot reach it, or is the identity there) is not run: its result is the corrupted run's. Their
losses are summed, so each R gets its own loss's gradient and Adam updates it as it would
alone, on the same documents in the same order (`das_loop` trains each alone through a forward
hook, pyvene's way; the tests compare them). What it reads before training:
mecheval.interventions.das_data. Parameters, defaults and cost: docs/das.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pandas as pd
import torch
from torch import nn
from torch.autograd.function import once_differentiable
from tqdm.auto import tqdm

from mecheval.checks import check_int
from mecheval.interventions.das_data import (
    DEFAULT_DIMS,
    Combination,
    SiteData,
    answers,
    prepare,
    unswapped,
)
from mecheval.interventions.das_last_block import LastBlock, last_blocks
from mecheval.interventions.engine import block_output_at, run_patched
from mecheval.interventions.plan import CELL_COLUMNS, check_batch
from mecheval.layers.resume import context_rows
from mecheval.tasks import Batch

COLUMNS = (*CELL_COLUMNS, "k", "width", "correct", "p_target")


@dataclass(frozen=True)
class DasSettings:
    """How the rotations are trained (docs/das.md).

    Attributes:
        steps: optimiser steps.
        lr: Adam's learning rate.
        batch_size: training documents per step (drawn without replacement, one epoch after
            another, in an order set by `seed`).
        holdout: the share of the documents held out for IIA (the last ones).
        seed: seeds the document order and every R's initialisation (each R's from its own
            combination, so a combination starts the same whatever else trains with it).
    """

    steps: int = 200
    lr: float = 1e-2
    batch_size: int = 64
    holdout: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            check_int(f"DAS {name}", getattr(self, name), 1)
        if not self.lr > 0:
            raise ValueError(f"DAS lr must be > 0, got {self.lr!r}")
        if not 0 < self.holdout < 1:
            raise ValueError(f"DAS holdout must be in (0, 1), got {self.holdout!r}")


class DasResult(NamedTuple):
    """What `das` returns: the table, and the learned bases.

    Attributes:
        table: a row per (held-out document, layer, site, position, k): columns `COLUMNS`.
        bases: one orthonormal basis R per learned combination, (width, k) float32 on the CPU,
            keyed `basis_key(site, position, k)` ("layers.1.block_input/value/4"); the full
            swap (k = width) and no swap (k = 0) learn none. The swap it learned:
            corrupted + (clean - corrupted) @ R @ R.T, on the activation flattened to width numbers.
    """

    table: pd.DataFrame
    bases: dict[str, torch.Tensor]


def basis_key(site: str, position: str, k: int) -> str:
    """The key of a combination's basis in `DasResult.bases`: "{site}/{position}/{k}", the
    site by its full name ("layers.1.block_input")."""
    return f"{site}/{position}/{k}"


class Bases(nn.Module):
    """The orthonormal (width, k) bases of several combinations of one site and one k: R is the
    Q factor of a free (width, k) matrix (its reduced QR), all n as one (n, width, k) parameter,
    each initialised orthonormal from its combination's seed.

    pyvene parametrises R by Householder reflections (torch's `orthogonal`); both reach every
    orthonormal R, and the swap depends on R R^T alone, but a step of QR costs 4x to 160x less
    (docs/das.md, measured by benchmarks/das_rotation_cost.py), so the trajectories differ from
    pyvene's, not what they can find."""

    def __init__(self, width: int, k: int, seeds: Sequence[int]) -> None:
        super().__init__()
        free = torch.empty(len(seeds), width, k)
        for i, seed in enumerate(seeds):
            nn.init.orthogonal_(free[i], generator=torch.Generator().manual_seed(seed))
        self.free = nn.Parameter(free)

    @property
    def weight(self) -> torch.Tensor:
        """(n, width, k) the bases R, orthonormal columns."""
        return torch.linalg.qr(self.free).Q

    def swap(self, corrupted: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        """corrupted, clean (n, rows, width) -> corrupted + (clean - corrupted) R R^T, each of
        the n with its own R."""
        R = self.weight
        return corrupted + torch.bmm(torch.bmm(clean - corrupted, R), R.mT)


def das(
    model,
    batch: Batch,
    corrupted: torch.Tensor,
    sites: Sequence[str] | None = None,
    positions: Sequence[str] | None = None,
    dims: Sequence[int] = DEFAULT_DIMS,
    layers=None,
    settings: DasSettings | None = None,
    progress: bool = False,
) -> DasResult:
    """Train and evaluate DAS for every (site, position, k) combination at once.

    Args:
        model: a `mecheval.models` model (its weights are not changed).
        batch: the clean documents, a task `Batch`.
        corrupted: (n, L) their counterfactuals (the documents patched), e.g.
            `task.corrupt(batch, "key")`.
        sites: short site names ("block_input", "state", ...; default every site).
        positions: position specs as the interchange grid takes them (default the named ones).
        dims: subspace sizes k; those above a site's width are left out for it, and the width
            itself is always added (the full swap, the grid's patch).
        layers: layer indices (default all).
        settings: training settings (default `DasSettings()`).
        progress: a progress bar over steps.

    Returns:
        `DasResult`: the table, a row per (held-out document, layer, site, position, k),
        columns `COLUMNS` (`correct`: whether the patched model's top answer is the clean
        document's answer, `p_target` its probability); and the learned bases R by `basis_key`.
    """
    check_batch(batch)
    settings = settings or DasSettings()
    data, combos, target, query, train, held = prepare(
        model, batch, corrupted, sites, positions, dims, layers, settings.holdout
    )
    with _frozen(model):
        groups = _groups(model, data, combos, query, settings.seed)
        learning = [group for group in groups if len(group.bases)]  # not the full swaps alone
        if learning:
            _train(model, learning, train, query, target, settings, progress)
        with torch.no_grad():
            parts = [group.evaluate(model, held, query, target) for group in groups]
    parts.append(unswapped(model, data, held, target))
    bases = {key: R for group in groups for key, R in group.learned().items()}
    return DasResult(pd.concat(parts, ignore_index=True)[list(COLUMNS)], bases)


def _train(model, groups, train, query, target, settings: DasSettings, progress: bool) -> None:
    parameters = [p for g in groups for p in g.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=settings.lr)
    order = _minibatches(train, settings)
    steps = tqdm(range(settings.steps), disable=not progress, desc="DAS", unit="step")
    for _ in steps:
        docs = next(order)
        optimizer.zero_grad(set_to_none=True)
        for group in groups:
            loss = group.loss(model, docs, query, target)
            if loss is not None:
                loss.backward()
        for p in parameters:  # a basis no live row reached: zero, and Adam steps it as alone
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        optimizer.step()


@contextmanager
def _frozen(model) -> Iterator[None]:
    """The model in eval mode with no parameter needing a gradient, as it was after."""
    was_training = model.training
    wanted = [(p, p.requires_grad) for p in model.parameters()]
    model.eval()
    for p, _ in wanted:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in wanted:
            p.requires_grad_(flag)
        model.train(was_training)


def _minibatches(train: torch.Tensor, settings: DasSettings) -> Iterator[torch.Tensor]:
    """Training documents, `batch_size` at a time, each epoch in a new order (seeded)."""
    g = torch.Generator().manual_seed(settings.seed)
    size = min(settings.batch_size, len(train))
    while True:
        order = train[torch.randperm(len(train), generator=g).to(train.device)]
        for first in range(0, len(order) - size + 1, size):
            yield order[first : first + size]


class AnswerCrossEntropy(torch.autograd.Function):
    """Per row, the cross-entropy of the answer under the tied head: F.cross_entropy of
    hidden @ weight^T, in two products instead of three (the forward keeps the softmax, whose
    answer entry less one is the logits' gradient) and no log-softmax tensor. weight gets no
    gradient (the model is frozen)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor):
        p = hidden @ weight.T  # the logits, turned into the softmax in place
        top = p.max(-1, keepdim=True).values
        chosen = p.gather(1, target[:, None])[:, 0] - top[:, 0]
        p.sub_(top).exp_()
        total = p.sum(-1, keepdim=True)
        p.div_(total)
        ctx.save_for_backward(p, weight, target)
        return total[:, 0].log() - chosen

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        p, weight, target = ctx.saved_tensors  # p is turned into the gradient in place:
        p[torch.arange(len(p), device=p.device), target] -= 1  # one backward per forward
        return p.mul_(grad[:, None]) @ weight, None, None


class _SiteGroup(nn.Module):
    """Every combination of one site: their bases by k, and their patched runs (`last`: run
    in the last block without its recurrence, mecheval.interventions.das_last_block)."""

    def __init__(
        self, data: SiteData, combos: list[Combination], seed: int, last: LastBlock | None = None
    ) -> None:
        super().__init__()
        self.data, self.combos, self.last = data, combos, last
        self.ks = sorted({c.k for c in combos})
        self.bases = nn.ModuleDict(  # the full swap (k = width) has nothing to learn
            {
                str(k): Bases(data.width, k, [c.seed(seed) for c in combos if c.k == k])
                for k in self.ks
                if k < data.width
            }
        )

    def learned(self) -> dict[str, torch.Tensor]:
        """Each learned combination's basis R (width, k), by `basis_key`."""
        bases = {}
        for k, module in self.bases.items():
            mine = [c for c in self.combos if c.k == int(k)]
            for combo, R in zip(mine, module.weight.detach().float().cpu(), strict=True):
                bases[basis_key(combo.site.name, combo.label, combo.k)] = R.contiguous()
        return bases

    def _patched(self, model, docs, query, learning: bool = False):
        """(the head input at the query of every (combination, document) row, k-group by
        k-group in combination order (`learning`: only those with a basis to learn); the rows'
        documents): the rows that are not live (`SiteData.live`) take the corrupted run's."""
        rows, live, hidden = self._live(model, docs, query, learning)
        patched = self.data.corrupted_hidden[rows].to(hidden.dtype)
        patched[live] = hidden
        return patched, rows

    def _live(self, model, docs, query, learning: bool) -> tuple:
        """(every row's document, which rows are live, the head input at the query of those),
        the rows as `_patched` orders them."""
        values, positions, starts, rows, labels, live = self._swapped(docs, learning)
        keep = live.nonzero()[:, 0]
        data = self.data
        if not len(keep):
            return rows, live, data.corrupted_hidden.new_empty(0, data.corrupted_hidden.shape[1])
        values, positions, starts, labels = (
            values[keep],
            positions[keep],
            starts[keep],
            labels[keep],
        )
        docs = rows[keep]
        values = values.view(len(values), *data.shape).to(data.residual.dtype)
        if data.block_input is not None and data.ref.short != "block_output":
            mixer_output = None if data.mixer_output is None else data.mixer_output[docs, positions]
            inputs = data.block_input[docs, positions]
            values = block_output_at(model, data.ref, values, inputs, mixer_output)
        if self.last is not None:
            return rows, live, self.last.hidden(model, values, labels, docs)
        return rows, live, _run_rows(model, data, values, positions, starts, docs, query)

    def _swapped(self, docs, learning: bool) -> tuple:
        """(values (rows, width): the corrupted run's activations with the clean run's swapped
        in inside each combination's subspace; each row's patched position, resume point, document,
        position label (its index among the site's) and whether it is live)."""
        data = self.data
        index = {label: i for i, label in enumerate(data.positions)}
        values, positions, rows, starts, labels, live = [], [], [], [], [], []
        for k in self.ks:
            if learning and k == data.width:
                continue
            mine = [c for c in self.combos if c.k == k]
            # (m, docs, width) each
            corrupted = torch.stack([data.corrupted[c.label][docs] for c in mine])
            clean = torch.stack([data.clean[c.label][docs] for c in mine])
            swapped = clean if k == data.width else self.bases[str(k)].swap(corrupted, clean)
            values.append(swapped.flatten(0, 1))
            positions += [data.positions[c.label][docs] for c in mine]
            starts += [data.starts[c.label][docs] for c in mine]
            rows += [docs] * len(mine)
            labels += [torch.full_like(docs, index[c.label]) for c in mine]
            live += [data.live[c.label][docs] for c in mine]
        return (
            torch.cat(values),
            torch.cat(positions),
            torch.cat(starts),
            torch.cat(rows),
            torch.cat(labels),
            torch.cat(live),
        )

    def loss(self, model, docs, query, target) -> torch.Tensor | None:
        """The summed losses of the combinations, each the mean cross-entropy of the target
        answer over the documents, less the rows that are not live (constants, whose runs are
        the corrupted run's); None where no row is live."""
        rows, live, hidden = self._live(model, docs, query, learning=True)
        if not len(hidden):
            return None
        weight = model.unembedding.float()
        return AnswerCrossEntropy.apply(hidden.float(), weight, target[rows[live]]).sum() / len(
            docs
        )

    def evaluate(self, model, docs, query, target) -> pd.DataFrame:
        """A row per (combination, held-out document): `correct` and `p_target` of the patched
        run (the corrupted run's for the rows that are not live)."""
        rows, live, hidden = self._live(model, docs, query, learning=False)
        order = [c for k in self.ks for c in self.combos if c.k == k]
        n = len(docs)
        correct, p_target = (
            np.tile(a, len(order))
            for a in answers(model, self.data.corrupted_hidden[docs], target[docs])
        )
        at = live.cpu().numpy()
        correct[at], p_target[at] = answers(model, hidden, target[rows[live]])
        ref = self.data.ref
        return pd.DataFrame(
            {
                "example": docs.repeat(len(order)).cpu().numpy(),
                "layer": ref.layer,
                "site": ref.short,
                "position": np.repeat([c.label for c in order], n),
                "position_index": torch.cat([self.data.positions[c.label][docs] for c in order])
                .cpu()
                .numpy(),
                "k": np.repeat([c.k for c in order], n),
                "width": self.data.width,
                "correct": correct,
                "p_target": p_target,
            }
        )


def _run_rows(model, data: SiteData, values, positions, starts, rows, query) -> torch.Tensor:
    """(rows, d_model) the head input at each row's query with `values` put in at its position:
    the site patched, or (a site after its block's mixer) the block's output there; on the
    engine (`run_patched`), from the corrupted run's contexts at each row's resume point."""

    def contexts(start: int, first: int, docs: torch.Tensor) -> list:
        return [context_rows(c, docs) for c in data.contexts[start][first:]]

    return run_patched(
        model,
        data.ref.name,
        data.first_block,
        data.residual,
        values,
        rows,
        positions,
        starts,
        query,
        contexts,
        output=data.block_input is not None,
    )


def _groups(model, data: dict[str, SiteData], combos: dict, query, seed: int) -> list[_SiteGroup]:
    last = last_blocks(model, data, query)
    return [_SiteGroup(data[name], combos[name], seed, last.get(name)) for name in combos]
