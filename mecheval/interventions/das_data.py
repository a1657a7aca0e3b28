"""What DAS reads before it trains (mecheval.interventions.das): the (site, position, k)
combinations, each site's activations at the patched positions in the clean and corrupted
runs, the corrupted run's residual and contexts its patched runs start from, and the no-swap
rows (k = 0), the corrupted documents unpatched.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from mecheval.interventions.engine import UNSHIFTED, corrupted_run, hidden_at
from mecheval.interventions.plan import (
    AFTER_MIXER,
    AFTER_MLP_INPUT,
    METRIC_ROWS,
    SiteRef,
    _resume_points,
    query_reach,
    reaches_query,
    select_sites,
)
from mecheval.interventions.positions import expand_positions, resolve_position

DEFAULT_DIMS = (1, 2, 4, 8, 16, 32, 64)
# Bytes the corrupted run's contexts at the resume points may take (as the interchange grid's
# default).
GRID_MEMORY_BUDGET = 1 << 30


@dataclass(frozen=True)
class Combination:
    """One (site, position label, k): the unit DAS trains one R for."""

    site: SiteRef
    label: str
    k: int

    def seed(self, seed: int) -> int:
        key = f"{self.site.name}|{self.label}|{self.k}".encode()
        return (zlib.crc32(key) + 1_000_003 * seed) % (2**63)


@dataclass
class SiteData:
    """What one site's combinations need, read once from the clean and corrupted runs:
    activations at each label's positions (label -> (n, width), in the compute dtype), the
    corrupted run's residual entering the block patched runs start at (the site's, or the next
    one for a site after its block's mixer, as the interchange grid runs them), and the
    positions."""

    ref: SiteRef
    width: int
    shape: tuple[int, ...]  # the activation's shape after the batch axis
    corrupted: dict[str, torch.Tensor]
    clean: dict[str, torch.Tensor]
    positions: dict[str, torch.Tensor]
    starts: dict[str, torch.Tensor]  # label -> (n,) the resume point each row runs from
    residual: torch.Tensor  # (n, needed, d_model) entering block first_block
    contexts: dict[int, list]  # resume point -> every block's context there in the corrupted run
    first_block: int
    # After the mixer: the corrupted run's input of the site's block, and (after the MLP's
    # input) its mixer's output, (n, needed, d_model) each, for one-position runs of the block.
    block_input: torch.Tensor | None = None
    mixer_output: torch.Tensor | None = None
    # The corrupted run's mixer input in block first_block (n, needed, d_model); None past the last.
    mixer_input: torch.Tensor | None = None
    # label -> (n,) the documents whose swap there can change the query (`mark_live`), and
    # (n, d_model) the corrupted run's head input at each query, every other row's result.
    live: dict[str, torch.Tensor] = field(default_factory=dict)
    corrupted_hidden: torch.Tensor | None = None


def prepare(model, batch, corrupted, sites, positions, dims, layers, holdout: float):
    """(site data by name, combinations by site name, the answers, the query positions, the
    training documents, the held-out documents): every site's activations read once from the
    clean and corrupted runs, with the resume points of the corrupted run."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    corrupted = torch.as_tensor(corrupted, device=device)
    if corrupted.shape != batch.tokens.shape:
        raise ValueError(
            f"corrupted must have the batch's shape {tuple(batch.tokens.shape)}, "
            f"got {tuple(corrupted.shape)}"
        )
    n, length = batch.tokens.shape
    held_n = check_holdout(holdout, n)
    dims = sorted({int(k) for k in dims})
    if not dims or dims[0] < 1:
        raise ValueError(f"dims must be subspace sizes >= 1, got {dims}")
    labels = expand_positions(positions, length, batch.roles)
    where = {label: resolve_position(label, batch) for label in labels}
    query = batch.positions["query"]
    needed = int(query.max()) + 1
    refs = select_sites(model, layers, sites)
    data = _read(model, refs, where, batch.tokens, corrupted, needed)
    left_out(dims, {name: site.width for name, site in data.items()})
    _add_resume_points(model, data, where, corrupted, query, needed)
    _mark_live(model, data, query)
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


def check_holdout(holdout: float, n: int) -> int:
    """The number of the `n` documents that `holdout` holds out for IIA; ValueError when it
    leaves none to hold out or none to train on."""
    held = int(round(holdout * n))
    if held < 1:
        raise ValueError(f"holdout {holdout} of {n} documents holds none out: raise it")
    if n - held < 1:
        raise ValueError(f"holdout {holdout} of {n} documents leaves none to train on: lower it")
    return held


def left_out(dims, widths: dict[str, int]) -> dict[str, list[int]]:
    """Per site, the sizes of `dims` above its width (left out there: its full swap is its
    width); ValueError naming the sizes above every site's width (nothing to search at
    them)."""
    nowhere = [k for k in dims if all(k > width for width in widths.values())]
    if nowhere:
        shown = ", ".join(f"{name} {width}" for name, width in widths.items())
        raise ValueError(f"dims {nowhere}: larger than every site's width ({shown})")
    dropped = {name: [k for k in dims if k > width] for name, width in widths.items()}
    return {name: ks for name, ks in dropped.items() if ks}


def _read(model, refs, where, tokens, corrupted, needed) -> dict[str, SiteData]:
    """Every site's activations at each label's positions in the clean and corrupted runs,
    and the corrupted run's residual entering each site's block."""
    labels = list(where)
    at = torch.stack([where[label] for label in labels], dim=1)  # (n, P)
    reads = {r.name: (at if r.short == "state" else None) for r in refs}
    reads.update({f"layers.{r.layer}.block_input": None for r in refs})
    last = len(model.layers) - 1
    first = {r.layer + 1 if r.short in AFTER_MIXER else r.layer for r in refs}
    reads.update({f"layers.{layer}.mixer_input": None for layer in first if layer <= last})
    reads.update({f"layers.{r.layer}.block_output": None for r in refs if r.short in AFTER_MIXER})
    reads.update(
        {f"layers.{r.layer}.mixer_output": None for r in refs if r.short in AFTER_MLP_INPUT}
    )
    runs = {}
    with torch.no_grad():
        for name, tokens_of in (("clean", tokens), ("corrupted", corrupted)):
            with model.intervene(reads=reads) as record:
                model.forward_from(0, model.embed(tokens_of), head=False)
            runs[name] = dict(record)
    rows = torch.arange(len(at), device=at.device)
    data = {}
    for ref in refs:
        per_label = {}
        for which in ("clean", "corrupted"):
            values = runs[which][ref.name]
            if ref.short == "state":  # (n, P, *state): the states after each label's position
                picked = {label: values[:, j] for j, label in enumerate(labels)}
            else:
                picked = {label: values[rows, where[label]] for label in labels}
            per_label[which] = picked
        shape = tuple(per_label["clean"][labels[0]].shape[1:])
        flat = {
            which: {lab: v.reshape(len(v), -1).float() for lab, v in per.items()}
            for which, per in per_label.items()
        }
        width = int(np.prod(shape))
        data[ref.name] = SiteData(
            ref,
            width,
            shape,
            flat["corrupted"],
            flat["clean"],
            where,
            {},
            *_entering(ref, runs["corrupted"], needed),
        )
        mixer_input = f"layers.{data[ref.name].first_block}.mixer_input"
        if mixer_input in runs["corrupted"]:
            data[ref.name].mixer_input = runs["corrupted"][mixer_input][:, :needed]
    return data


def _add_resume_points(model, data, where, corrupted, query, needed) -> None:
    """Each row's resume point (the interchange grid's: the largest at or before its patch;
    0 where the model cannot resume) and the corrupted run's contexts there."""
    n = len(corrupted)
    points: list[int] = []
    if model.can_resume(0):
        positions = torch.cat(list(where.values()))
        points = _resume_points(model, positions, needed, n, GRID_MEMORY_BUDGET)
    contexts: dict[int, list] = {0: [None] * len(model.layers)}
    with torch.no_grad():
        embedded = model.embed(corrupted)
        if points:
            hidden, _, contexts = corrupted_run(model, embedded, query, {}, points, needed)
        else:
            hidden = hidden_at(model, 0, embedded[:, :needed], query)
    table = torch.tensor(points or [0], device=query.device)
    starts = {
        label: table[torch.searchsorted(table, at, right=True) - 1] for label, at in where.items()
    }
    for site in data.values():
        site.starts, site.contexts, site.corrupted_hidden = starts, contexts, hidden


def _mark_live(model, data: dict[str, SiteData], query: torch.Tensor) -> None:
    """Each site's live rows: those whose swap can change the logits at the query, at every
    k. Not live: a patch that cannot reach the query (after it; the state after it; after the
    last block's mixer but not at it: plan.reaches_query), or whose clean and corrupted
    activations are equal (the documents agree up to there, or a token-local site where they
    hold the same token), so that every swap there is the identity. Either way the patched
    run is the corrupted run, and no R gets a gradient from the row."""
    reach = query_reach(model)
    for site in data.values():
        site.live = {
            label: reaches_query(site.ref, at, query, reach)
            & (site.clean[label] != site.corrupted[label]).any(1)
            for label, at in site.positions.items()
        }


def _entering(ref: SiteRef, corrupted: dict, needed: int) -> tuple:
    """(residual, contexts, first_block, block_input, mixer_output) of a site's SiteData: a
    site after its block's mixer restarts at the next block, on the corrupted run's block
    output with the patched position's put in (`block_output_at`)."""

    def read(short: str) -> torch.Tensor:
        return corrupted[f"layers.{ref.layer}.{short}"][:, :needed]

    if ref.short not in AFTER_MIXER:
        return read("block_input"), {}, ref.layer, None, None
    mixer_output = read("mixer_output") if ref.short in AFTER_MLP_INPUT else None
    return read("block_output"), {}, ref.layer + 1, read("block_input"), mixer_output


@torch.no_grad()
def unswapped(model, data: dict[str, SiteData], docs, target) -> pd.DataFrame:
    """The k = 0 rows of every (site, position): the corrupted documents unpatched (the
    corrupted run's head input at the query), whose IIA (how often the corrupted run alone
    gives the clean document's answer) a swap's is measured from."""
    hidden = next(iter(data.values())).corrupted_hidden[docs]
    correct, p_target = answers(model, hidden, target[docs])
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
                "p_target": p_target,
            }
        )
        for site in data.values()
        for label in site.positions
    ]
    return pd.concat(frames, ignore_index=True)


def answers(model, hidden: torch.Tensor, wanted: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(correct, p_target) per row of `hidden` (rows, d_model), a head input: whether the top
    answer of the tied head is `wanted` (rows,), and that answer's probability. The logits are
    formed METRIC_ROWS rows at a time into one buffer, in base 2 (from the head input times
    log2(e): exp2 of them is exp of theirs; the head is not copied), and within +-UNSHIFTED
    need no shift in their log-sum-exp (as the interchange grid's metrics:
    mecheval.interventions.grid)."""
    hidden = hidden.float()
    weight = model.unembedding.detach().float()  # the head itself when it is float32
    bound = float(weight.norm(dim=1).max()) * math.log2(math.e)
    correct = torch.empty(len(hidden), dtype=torch.bool, device=hidden.device)
    log2_p = hidden.new_empty(len(hidden))
    buffer = hidden.new_empty(min(METRIC_ROWS, len(hidden)), len(weight))
    for first in range(0, len(hidden), METRIC_ROWS):
        block = slice(first, first + METRIC_ROWS)
        part = hidden[block]
        unshifted = float(part.norm(dim=1).max()) * bound <= UNSHIFTED
        logits2 = torch.mm(part * math.log2(math.e), weight.T, out=buffer[: len(part)])
        chosen = logits2.gather(1, wanted[block, None])[:, 0]
        correct[block] = logits2.argmax(-1) == wanted[block]
        if unshifted:
            lse2 = logits2.exp2_().sum(-1).log2()
        else:
            top = logits2.amax(-1, keepdim=True)
            lse2 = top[:, 0] + logits2.sub_(top).exp2_().sum(-1).log2()
        log2_p[block] = chosen - lse2
    return correct.cpu().numpy(), log2_p.exp2().cpu().numpy()
