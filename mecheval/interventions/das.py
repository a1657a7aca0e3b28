"""Distributed alignment search (DAS): in how many dimensions of an activation does the key-value
association live?

For a site at a position (a (B, L, C) site, or a mixer's recurrent state after the position,
flattened) and a subspace size k, DAS learns an orthonormal basis R (C, k) such that swapping
the base document's activation for the source's in that subspace,

    patched = base + (source - base) R R^T,

makes the model give the answer the causal variable says it should after the swap (Geiger et
al. 2024; pyvene's low-rank rotated-space intervention: the first k coordinates of a rotation).
R is trained by gradient descent on the cross-entropy of that answer, the model's weights
frozen; the interchange intervention accuracy (IIA) on held-out documents then says whether k
dimensions carry the variable. At k = C, R R^T = I and the patch is the interchange grid's;
k = 0 rows are the base run unpatched, the level a swap's IIA is measured from.

Counterfactual pairs are the task's, as the grid runs them: the base is the corrupted document
(key or value corrupted), the source the original; the causal variable is the value bound to
the queried key, so after a swap that carries it the model should give the original's answer.

Batched: every (site, position, k) combination trains at once, each with its own R: per site
and step, one backward over (combinations x documents) rows, each row run from the site's
block on, from the base run's context at a resume point at or before its patch (as the
interchange grid runs its cells), and read out at the query alone. Their losses are summed, so
each R gets its own loss's gradient and Adam updates it as it would alone, on the same
documents in the same order (`das_loop` trains each alone through a forward hook, pyvene's
way; the tests compare them). Parameters, defaults and cost: docs/das.md.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from tqdm.auto import tqdm

from mecheval.interventions.grid import base_run, block_output_at, hidden_at
from mecheval.interventions.plan import (
    AFTER_MIXER,
    AFTER_MLP_INPUT,
    CELL_COLUMNS,
    SiteRef,
    _resume_points,
    check_batch,
    select_sites,
)
from mecheval.interventions.positions import expand_positions, resolve_position
from mecheval.layers.resume import context_rows
from mecheval.tasks import Batch

DEFAULT_DIMS = (1, 2, 4, 8, 16, 32, 64)
# Bytes the base contexts at the resume points may take (as the interchange grid's default).
GRID_MEMORY_BUDGET = 1 << 30
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
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DAS {name} must be an int >= 1, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"DAS lr must be > 0, got {self.lr!r}")
        if not 0 < self.holdout < 1:
            raise ValueError(f"DAS holdout must be in (0, 1), got {self.holdout!r}")


@dataclass(frozen=True)
class Combination:
    """One (site, position label, k): the unit DAS trains one R for."""

    site: SiteRef
    label: str
    k: int

    def seed(self, seed: int) -> int:
        key = f"{self.site.name}|{self.label}|{self.k}".encode()
        return (zlib.crc32(key) + 1_000_003 * seed) % (2**63)


class Bases(nn.Module):
    """The orthonormal (width, k) bases of several combinations of one site and one k: R is the
    Q factor of a free (width, k) matrix (its reduced QR), all n as one (n, width, k) parameter,
    each initialised orthonormal from its combination's seed.

    pyvene parametrises R by Householder reflections (torch's `orthogonal`); both reach every
    orthonormal R, and the swap depends on R R^T alone, but QR and its gradient cost about a
    tenth as much at the residual stream's width and a thousandth at a 2048-float recurrent
    state (docs/das.md), so the trajectories differ from pyvene's, not what they can find."""

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

    def swap(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """base, source (n, rows, width) -> base + (source - base) R R^T, each of the n with its
        own R."""
        R = self.weight
        return base + torch.bmm(torch.bmm(source - base, R), R.mT)


@dataclass
class _SiteData:
    """What one site's combinations need, read once from the clean and corrupted runs:
    activations at each label's positions (label -> (n, width), in the compute dtype), the
    base's residual entering the block patched runs start at (the site's, or the next one for
    a site after its block's mixer, as the interchange grid runs them), and the positions."""

    ref: SiteRef
    width: int
    shape: tuple[int, ...]  # the activation's shape after the batch axis
    base: dict[str, torch.Tensor]
    source: dict[str, torch.Tensor]
    positions: dict[str, torch.Tensor]
    starts: dict[str, torch.Tensor]  # label -> (n,) the resume point each row runs from
    residual: torch.Tensor  # (n, needed, d_model) entering block first_block
    contexts: dict[int, list]  # resume point -> every block's base context there
    first_block: int
    # After the mixer: the base's input of the site's block, and (after the MLP's input) its
    # mixer's output, (n, needed, d_model) each, for one-position runs of the block.
    block_input: torch.Tensor | None = None
    mixer_output: torch.Tensor | None = None


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
) -> pd.DataFrame:
    """Train and evaluate DAS for every (site, position, k) combination at once.

    Args:
        model: a `mecheval.models` model (its weights are not changed).
        batch: the original documents (sources), a task `Batch`.
        corrupted: (n, L) their counterfactuals (bases), e.g. `task.corrupt(batch, at="key")`.
        sites: short site names ("block_input", "state", ...; default every site).
        positions: position specs as the interchange grid takes them (default the named ones).
        dims: subspace sizes k; those above a site's width are left out for it, and the width
            itself is always added (the full swap, the grid's patch).
        layers: layer indices (default all).
        settings: training settings (default `DasSettings()`).
        progress: a progress bar over steps.

    Returns:
        a row per (held-out document, layer, site, position, k): columns `COLUMNS`, `correct`
        whether the patched model's top answer is the source's answer, `p_target` its
        probability.
    """
    check_batch(batch)
    settings = settings or DasSettings()
    data, combos, target, query, train, held = _prepare(
        model, batch, corrupted, sites, positions, dims, layers, settings
    )
    with _frozen(model):
        groups = _groups(data, combos, settings.seed)
        learning = [group for group in groups if len(group.bases)]  # not the full swaps alone
        if learning:
            _train(model, learning, train, query, target, settings, progress)
        with torch.no_grad():
            parts = [group.evaluate(model, held, query, target) for group in groups]
    parts.append(unswapped(model, data, corrupted, held, query, target))
    return pd.concat(parts, ignore_index=True)[list(COLUMNS)]


def _train(model, groups, train, query, target, settings: DasSettings, progress: bool) -> None:
    optimizer = torch.optim.Adam([p for g in groups for p in g.parameters()], lr=settings.lr)
    order = _minibatches(train, settings)
    steps = tqdm(range(settings.steps), disable=not progress, desc="DAS", unit="step")
    for _ in steps:
        docs = next(order)
        optimizer.zero_grad(set_to_none=True)
        for group in groups:
            group.loss(model, docs, query, target).backward()
        optimizer.step()


def _prepare(model, batch, corrupted, sites, positions, dims, layers, settings):
    device = next(model.parameters()).device
    batch = batch.to(device)
    base_tokens = torch.as_tensor(corrupted, device=device)
    if base_tokens.shape != batch.tokens.shape:
        raise ValueError(
            f"corrupted must have the batch's shape {tuple(batch.tokens.shape)}, "
            f"got {tuple(base_tokens.shape)}"
        )
    n, length = batch.tokens.shape
    held_n = int(round(settings.holdout * n))
    if held_n < 1 or n - held_n < 1:
        raise ValueError(
            f"DAS needs documents to train on and to hold out: {n} with holdout {settings.holdout}"
        )
    dims = sorted({int(k) for k in dims})
    if not dims or dims[0] < 1:
        raise ValueError(f"dims must be subspace sizes >= 1, got {dims}")
    labels = expand_positions(positions, length)
    where = {label: resolve_position(label, batch) for label in labels}
    query = batch.positions["query"]
    needed = int(query.max()) + 1
    refs = select_sites(model, layers, sites)
    data = _read(model, refs, where, batch.tokens, base_tokens, needed)
    _add_resume_points(model, data, where, base_tokens, query, needed)
    combos = {
        ref.name: [
            Combination(ref, label, k)
            for label in labels
            for k in [*(k for k in dims if k < data[ref.name].width), data[ref.name].width]
        ]
        for ref in refs
    }
    order = torch.arange(n, device=device)
    return data, combos, batch.answers, query, order[: n - held_n], order[n - held_n :]


def _read(model, refs, where, tokens, base_tokens, needed) -> dict[str, _SiteData]:
    """Every site's activations at each label's positions in the clean (source) and corrupted
    (base) runs, and the base's residual entering each site's block."""
    labels = list(where)
    at = torch.stack([where[label] for label in labels], dim=1)  # (n, P)
    reads = {r.name: (at if r.short == "state" else None) for r in refs}
    reads.update({f"layers.{r.layer}.block_input": None for r in refs})
    reads.update({f"layers.{r.layer}.block_output": None for r in refs if r.short in AFTER_MIXER})
    reads.update(
        {f"layers.{r.layer}.mixer_output": None for r in refs if r.short in AFTER_MLP_INPUT}
    )
    runs = {}
    with torch.no_grad():
        for name, tokens_of in (("source", tokens), ("base", base_tokens)):
            with model.intervene(reads=reads) as record:
                model.forward_from(0, model.embed(tokens_of), head=False)
            runs[name] = dict(record)
    rows = torch.arange(len(at), device=at.device)
    data = {}
    for ref in refs:
        per_label = {}
        for which in ("source", "base"):
            values = runs[which][ref.name]
            if ref.short == "state":  # (n, P, *state): the states after each label's position
                picked = {label: values[:, j] for j, label in enumerate(labels)}
            else:
                picked = {label: values[rows, where[label]] for label in labels}
            per_label[which] = picked
        shape = tuple(per_label["source"][labels[0]].shape[1:])
        flat = {
            which: {lab: v.reshape(len(v), -1).float() for lab, v in per.items()}
            for which, per in per_label.items()
        }
        width = int(np.prod(shape))
        data[ref.name] = _SiteData(
            ref,
            width,
            shape,
            flat["base"],
            flat["source"],
            where,
            {},
            *_entering(ref, runs["base"], needed),
        )
    return data


def _add_resume_points(model, data, where, base_tokens, query, needed) -> None:
    """Each row's resume point (the interchange grid's: the largest at or before its patch;
    0 where the model cannot resume) and the base run's contexts there."""
    n = len(base_tokens)
    points: list[int] = []
    if model.can_resume(0):
        positions = torch.cat(list(where.values()))
        points = _resume_points(model, positions, needed, n, GRID_MEMORY_BUDGET)
    contexts: dict[int, list] = {0: [None] * len(model.layers)}
    if points:
        with torch.no_grad():
            embedded = model.embed(base_tokens)
            _, _, contexts = base_run(model, embedded, query, {}, points, needed)
    table = torch.tensor(points or [0], device=query.device)
    starts = {
        label: table[torch.searchsorted(table, at, right=True) - 1] for label, at in where.items()
    }
    for site in data.values():
        site.starts, site.contexts = starts, contexts


def _entering(ref: SiteRef, base: dict, needed: int) -> tuple:
    """(residual, contexts, first_block, block_input, mixer_output) of a site's _SiteData: a
    site after its block's mixer restarts at the next block, on the base's block output with
    the patched position's put in (`block_output_at`)."""

    def read(short: str) -> torch.Tensor:
        return base[f"layers.{ref.layer}.{short}"][:, :needed]

    if ref.short not in AFTER_MIXER:
        return read("block_input"), {}, ref.layer, None, None
    mixer_output = read("mixer_output") if ref.short in AFTER_MLP_INPUT else None
    return read("block_output"), {}, ref.layer + 1, read("block_input"), mixer_output


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
    """Every combination of one site: their bases by k, and their patched runs."""

    def __init__(self, data: _SiteData, combos: list[Combination], seed: int) -> None:
        super().__init__()
        self.data, self.combos = data, combos
        self.ks = sorted({c.k for c in combos})
        self.bases = nn.ModuleDict(  # the full swap (k = width) has nothing to learn
            {
                str(k): Bases(data.width, k, [c.seed(seed) for c in combos if c.k == k])
                for k in self.ks
                if k < data.width
            }
        )

    def _patched(self, model, docs, query, learning: bool = False):
        """The head input at the query of every (combination, document) row, k-group by
        k-group in combination order (`learning`: only those with a basis to learn), and the
        rows' documents."""
        values, positions, starts, rows = self._swapped(docs, learning)
        data = self.data
        values = values.view(len(values), *data.shape).to(data.residual.dtype)
        if data.block_input is not None and data.ref.short != "block_output":
            mixer_output = None if data.mixer_output is None else data.mixer_output[rows, positions]
            inputs = data.block_input[rows, positions]
            values = block_output_at(model, data.ref, values, inputs, mixer_output)
        return _run_rows(model, data, values, positions, starts, rows, query), rows

    def _swapped(self, docs, learning: bool) -> tuple:
        """(values (rows, width): the base's activations with the source's swapped in inside
        each combination's subspace; each row's patched position, resume point and document)."""
        data = self.data
        values, positions, rows, starts = [], [], [], []
        for k in self.ks:
            if learning and k == data.width:
                continue
            mine = [c for c in self.combos if c.k == k]
            base = torch.stack([data.base[c.label][docs] for c in mine])  # (m, docs, width)
            source = torch.stack([data.source[c.label][docs] for c in mine])
            swapped = source if k == data.width else self.bases[str(k)].swap(base, source)
            values.append(swapped.flatten(0, 1))
            positions += [data.positions[c.label][docs] for c in mine]
            starts += [data.starts[c.label][docs] for c in mine]
            rows += [docs] * len(mine)
        return torch.cat(values), torch.cat(positions), torch.cat(starts), torch.cat(rows)

    def loss(self, model, docs, query, target) -> torch.Tensor:
        """The summed losses of the combinations: each the mean cross-entropy of the target
        answer over the documents."""
        hidden, rows = self._patched(model, docs, query, learning=True)
        per_row = AnswerCrossEntropy.apply(hidden.float(), model.unembedding.float(), target[rows])
        return per_row.view(-1, len(docs)).mean(1).sum()

    def evaluate(self, model, docs, query, target) -> pd.DataFrame:
        hidden, rows = self._patched(model, docs, query)
        logits = F.linear(hidden.float(), model.unembedding.float())
        wanted = target[rows]
        correct = (logits.argmax(-1) == wanted).cpu().numpy()
        chosen = logits.gather(1, wanted[:, None])[:, 0]
        p_target = (chosen - logits.logsumexp(-1)).exp().cpu().numpy()
        order = [c for k in self.ks for c in self.combos if c.k == k]
        n = len(docs)
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


def _run_rows(model, data: _SiteData, values, positions, starts, rows, query) -> torch.Tensor:
    """(rows, d_model) the head input at each row's query with `values` put in at its position:
    the site patched, or (a site after its block's mixer) the block's output there. Rows run in
    buckets by resume point, each from the base run's contexts there."""
    first, name = data.first_block, data.ref.name
    pieces, order = [], []
    for start in starts.unique().tolist():
        picked = (starts == start).nonzero()[:, 0]
        docs = rows[picked]
        resumed = None
        if start:
            resumed = [context_rows(c, docs) for c in data.contexts[start][first:]]
        suffix, at = data.residual[docs, start:], positions[picked] - start
        if data.block_input is not None:  # the next block reads exactly the patched output
            patched = suffix.index_put(
                (torch.arange(len(picked), device=at.device), at), values[picked]
            )
            pieces.append(hidden_at(model, first, patched, query[docs] - start, resumed))
        else:
            with model.intervene(patches={name: (at, values[picked])}):
                pieces.append(hidden_at(model, first, suffix, query[docs] - start, resumed))
        order.append(picked)
    return torch.cat(pieces)[torch.argsort(torch.cat(order))]


@torch.no_grad()
def unswapped(model, data: dict[str, _SiteData], base_tokens, docs, query, target) -> pd.DataFrame:
    """The k = 0 rows of every (site, position): the base documents run unpatched, whose IIA
    (how often the base alone gives the source's answer) a swap's is measured from."""
    tokens = torch.as_tensor(base_tokens, device=query.device)[docs]
    hidden = hidden_at(model, 0, model.embed(tokens), query[docs])
    logits = F.linear(hidden.float(), model.unembedding.float())
    wanted = target[docs]
    correct = (logits.argmax(-1) == wanted).cpu().numpy()
    p_target = (logits.gather(1, wanted[:, None])[:, 0] - logits.logsumexp(-1)).exp()
    frames = [
        pd.DataFrame(
            {
                "example": docs.cpu().numpy(),
                "layer": site.ref.layer,
                "site": site.ref.short,
                "position": label,
                "position_index": site.positions[label][docs].cpu().numpy(),
                "k": 0,
                "width": site.width,
                "correct": correct,
                "p_target": p_target.cpu().numpy(),
            }
        )
        for site in data.values()
        for label in site.positions
    ]
    return pd.concat(frames, ignore_index=True)


def _groups(data: dict[str, _SiteData], combos: dict, seed: int) -> list[_SiteGroup]:
    return [_SiteGroup(data[name], combos[name], seed) for name in combos]
