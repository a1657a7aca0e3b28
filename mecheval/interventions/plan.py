"""The plan of an interchange grid: which cells run, where each restarts, how they are chunked.

    plan = plan_grid(model, batch, positions=["all"])
    plan.summary()   # per site: cells, run, copied, restored, first block, forwards, positions

`interchange_grid` runs a plan (mecheval.interventions.grid). A cell is one (site, position
label, document); cells are stacked label-major, so cell i patches document example[i] at
position positions[i]. What a plan prunes and reuses:
- positions after the last query are never computed (`needed`);
- a cell whose patch cannot reach its document's query is not run (`reaches_query`: after
  the query; in the last block, after the mixer but not at the query, or at a site of the
  mixer's read-out, such as DeltaNet's queries, too far before it: `query_reach`);
- given the corrupted documents, a cell before its document's first corrupted token is not run
  either: the two documents agree there, so source and base activations (and states) agree and
  the patch is the identity (`before_corruption`); nor is a cell of a token-local site (one
  whose value at a position depends on the token there alone: the first block's input, its
  normalised input, its mixer's input projections; `token_local_sites`) at a position
  where the two documents hold the same token (`same_token`), nor of a window-local site (a
  short convolution's output: `window_local_sites`) where they hold the same tokens
  over its window (`same_window`);
- a cell of the first block's input at the one position where its document and the
  corruption differ gives the corrupted run the original's whole input: its results are the
  clean run's (`restored`, `only_difference`);
- cells of one site that equal those of a later one copy their results (`copied`): a block's
  output is the next block's input; in the last block, before the query, the block's input,
  its normalised input and its mixer's `reach_site` change the query's logits alike
  (`query_alike_sites`), and the last of them the grid holds runs; in the first block,
  where both documents hold the same token (its input, the residual, is then the same), a
  patch of the mixer's output makes the block's output the original's, as a patch of the
  block's output does;
- a cell restarts at its site's block (the next one for block_output), and, when every mixer
  from there on resumes (mecheval.layers.mixer), at the resume point at or before its
  position (`points`), from the base run's contexts there;
- cells are chunked so that a patched forward stays within the memory budget (`chunk`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from mecheval.interventions.positions import expand_positions, resolve_position
from mecheval.tasks import Batch


@dataclass(frozen=True)
class SiteRef:
    """A site of a model: its full name ("layers.1.mixer_output"), layer and short name."""

    name: str
    layer: int
    short: str

    @staticmethod
    def parse(name: str) -> SiteRef:
        _, layer, short = name.split(".", 2)
        return SiteRef(name, int(layer), short)


def select_sites(model, layers=None, sites=None) -> list[SiteRef]:
    """The model's sites, filtered by layer indices and short site names (None: all)."""
    refs = [SiteRef.parse(n) for n in model.site_names()]
    n_layers = len(model.layers)
    if layers is not None:
        layers = [layers] if isinstance(layers, int) else list(layers)
        bad = [layer for layer in layers if not 0 <= layer < n_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range: the model has layers 0..{n_layers - 1}")
        refs = [r for r in refs if r.layer in layers]
    if sites is not None:
        sites = [sites] if isinstance(sites, str) else list(sites)
        known = {r.short for r in refs}
        unknown = [s for s in sites if s not in known]
        if unknown:
            raise ValueError(f"unknown site(s) {unknown} for this model; it has {sorted(known)}")
        refs = [r for r in refs if r.short in sites]
    return refs


def _bytes_per_row(model, length: int) -> int:
    """A generous estimate of the memory one stacked row of a patched forward takes (its
    activations and the mixers' contexts; H3's generating state, 25x larger, is never held)."""
    d = model.config.d_model
    return 4 * length * (32 * d + model.context_size(length)) + 8 * model.config.vocab_size


# A block's sites after its mixer, from which on it acts on each position alone: their cells
# restart at the next block (from the block's output at the cell's position, see the grid).
# The columns naming a cell of a grid (interchange or DAS), one row per document.
CELL_COLUMNS = ("example", "layer", "site", "position", "position_index")
AFTER_MIXER = ("mixer_output", "mlp_input", "mlp_output", "block_output")
AFTER_MLP_INPUT = ("mlp_input", "mlp_output")  # (their block's output also needs its mixer's)


def _named(model, layer: int, shorts) -> list[str]:
    names = set(model.site_names())
    return [f"layers.{layer}.{short}" for short in shorts if f"layers.{layer}.{short}" in names]


def token_local_sites(model) -> list[str]:
    """Sites whose value at a position depends on the token there (and the position) alone:
    the first block's input, its normalised input and its mixer's `local_sites` (see
    mecheval.layers.mixer)."""
    return _named(model, 0, ["block_input", "mixer_input", *model.layers[0].mixer.local_sites])


def window_local_sites(model) -> dict[str, int]:
    """Sites of the first block whose value at a position depends on the tokens at it and the
    n - 1 before it alone (n the entry): its mixer's `window_sites`."""
    windows = model.layers[0].mixer.window_sites
    return {name: windows[name.split(".", 2)[2]] for name in _named(model, 0, windows)}


def query_alike_sites(model) -> list[str]:
    """Sites of the last block whose patches at a position before the query change the logits
    there alike: the block's input (its residual at that position reaches no other), its
    normalised input and its mixer's `reach_site`, in forward order."""
    last = len(model.layers) - 1
    reach = model.layers[last].mixer.reach_site
    return _named(model, last, ["block_input", "mixer_input"] + ([reach] if reach else []))


def query_reach(model) -> dict[str, int]:
    """Sites of the last block whose value at a position reaches the logits at that position
    and the next n - 1 alone (n the entry): those after its mixer (the block, the final norm
    and the head then act on each position alone: 1) and its mixer's `readout_sites`."""
    last = len(model.layers) - 1
    reach = dict.fromkeys(AFTER_MIXER, 1) | dict(model.layers[last].mixer.readout_sites)
    return {name: reach[name.split(".", 2)[2]] for name in _named(model, last, reach)}


def reaches_query(ref: SiteRef, positions: torch.Tensor, query: torch.Tensor, reach: dict):
    """Rows whose patch at `positions` can change the logits at their `query` (causality;
    `reach`: `query_reach(model)`, sites whose patch reaches a few positions alone)."""
    if ref.short == "state":  # the state after p feeds positions p + 1 on
        return positions < query
    if ref.name in reach:
        return (positions <= query) & (positions > query - reach[ref.name])
    return positions <= query


def before_corruption(
    positions: torch.Tensor, tokens: torch.Tensor, corrupted: torch.Tensor, example: torch.Tensor
) -> torch.Tensor:
    """Cells whose position lies before their document's first token that the corruption
    changed (a causal model computes the same activations there from both documents)."""
    differs = tokens != corrupted
    length = tokens.shape[1]
    first = torch.where(differs.any(1), differs.int().argmax(1), length)
    return positions < first[example]


def same_window(
    positions: torch.Tensor,
    tokens: torch.Tensor,
    corrupted: torch.Tensor,
    example: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """Cells whose document holds the same tokens in both documents at their position and the
    width - 1 before it (a window-local site has the same value there in both runs)."""
    differs = (tokens != corrupted).int()
    before = torch.nn.functional.pad(differs.cumsum(1), (1, 0))  # differences before t
    end = positions + 1
    start = (end - width).clamp(min=0)
    return before[example, end] == before[example, start]


def only_difference(
    positions: torch.Tensor, tokens: torch.Tensor, corrupted: torch.Tensor, example: torch.Tensor
) -> torch.Tensor:
    """Cells at the one position where their document and its corruption differ (patching the
    first block's input there gives the corrupted run the original document's input)."""
    differs = tokens != corrupted
    return (differs.sum(1) == 1)[example] & differs[example, positions]


def same_token(
    positions: torch.Tensor, tokens: torch.Tensor, corrupted: torch.Tensor, example: torch.Tensor
) -> torch.Tensor:
    """Cells whose document holds the same token at their position in both documents (a
    token-local site has the same value there in both runs)."""
    return tokens[example, positions] == corrupted[example, positions]


# Cells are bucketed by position into resume points: multiples of a stride that make at most
# this many (each bucket is one more forward per site, each point more positions skipped: 8 was
# fastest on CPU at the study's shape, between 4 and 40, for attention, Mamba and DeltaNet),
# plus every position where at least this share of the documents has a cell (the divider and
# the query of AR documents, at the same position in every document): those cells then run
# from their own position.
MAX_RESUME_POINTS = 8
SHARED_POSITION = 0.5


def _resume_points(model, positions: torch.Tensor, needed: int, n: int, budget: int) -> list[int]:
    """Where resumed runs may start (see MAX_RESUME_POINTS), kept only while the contexts
    stored there (n rows each) fit in half the memory budget."""
    stride = max(1, -(-needed // MAX_RESUME_POINTS))
    unique, counts = positions.unique(return_counts=True)
    points = {p // stride * stride for p in unique.tolist()}
    shared = zip(unique.tolist(), counts.tolist(), strict=True)
    points |= {p for p, c in shared if c >= SHARED_POSITION * n}
    points = sorted(p for p in points if 0 <= p < needed)
    context_bytes = sum(4 * n * model.context_size(p) for p in points)
    return points if context_bytes <= budget // 2 else []


@dataclass(frozen=True)
class SiteCells:
    """The cells of one site: those that run (`live`, indices into the stacked cells), the
    block their patched forwards start at, each live cell's resume point, the cells whose
    results are those of site `copy_from` (`copied`, empty when None), and those whose results
    are the clean run's (`restored`)."""

    ref: SiteRef
    first_block: int
    live: torch.Tensor
    starts: torch.Tensor
    copied: torch.Tensor
    restored: torch.Tensor
    copy_from: str | None = None


@dataclass(frozen=True)
class GridPlan:
    """An interchange grid's plan (see the module docstring)."""

    labels: list[str]
    positions: torch.Tensor  # (P n,) the patched position of each stacked cell
    example: torch.Tensor  # (P n,) its document
    needed: int  # positions computed: up to the last query
    points: list[int]  # resume points (empty: every cell restarts at position 0)
    chunk: int  # cells per patched forward
    sites: list[SiteCells]
    memory_budget: int

    def summary(self) -> pd.DataFrame:
        """Per site: cells, cells run, cells copied from another site, the first block run,
        patched forwards, and positions run (summed over the cells run: from its resume point
        to the last query)."""
        rows = []
        for s in self.sites:
            starts = s.starts.tolist()
            forwards = sum(-(-starts.count(p) // self.chunk) for p in sorted(set(starts)))
            rows.append(
                {
                    "layer": s.ref.layer,
                    "site": s.ref.short,
                    "cells": len(self.positions),
                    "run": len(s.live),
                    "copied": len(s.copied),
                    "restored": len(s.restored),
                    "first_block": s.first_block,
                    "forwards": forwards,
                    "positions_run": int(sum(self.needed - p for p in starts)),
                }
            )
        return pd.DataFrame(rows)


def check_batch(batch: Batch) -> None:
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be a mecheval.tasks.Batch, got {type(batch).__name__}")
    if len(batch) == 0:
        raise ValueError("batch is empty: interchange_grid needs at least one document")


def _copies(ref: SiteRef, runs: dict, alike: list, before_query, same) -> tuple:
    """(the cells of `ref` whose results equal another site's, that site's name or None): see
    the module docstring; `runs` maps each site of the grid to the cells that change its
    query, `same` marks the cells whose position holds the same token in both documents."""
    none = torch.zeros_like(before_query)
    next_input = f"layers.{ref.layer + 1}.block_input"
    if ref.name in alike[:-1]:
        return runs[ref.name] & runs[alike[-1]] & before_query, alike[-1]
    if ref.short == "block_output" and next_input in runs:  # the same tensor
        return runs[ref.name] & runs[next_input], next_input
    # The first block's input (its residual) is token-local: where the documents hold the
    # same token, the patched mixer output makes the block's output the original's there.
    output = "layers.0.block_output"
    if ref.name == "layers.0.mixer_output" and output in runs:
        return runs[ref.name] & runs[output] & same, output
    return none, None


def plan_grid(
    model,
    batch: Batch,
    layers=None,
    sites=None,
    positions=None,
    *,
    corrupted: torch.Tensor | None = None,
    memory_budget: int = 1 << 30,
    alike: bool = True,
) -> GridPlan:
    """The plan `interchange_grid` runs for these arguments (the same ones; the corrupted
    documents, keyword here, only prune the cells whose patch is the identity, before each
    document's corruption or at a token-local site where the documents agree: without them
    the plan counts those cells as run). `alike` False runs the query-alike sites' cells
    too: their patches change the query alike only when each site's values are those one
    run computes (not for a mean ablation's means)."""
    check_batch(batch)
    device = next(model.parameters()).device
    batch = batch.to(device)
    n, length = batch.tokens.shape
    labels = expand_positions(positions, length, batch.roles)
    where = {label: resolve_position(label, batch) for label in labels}
    query = batch.positions["query"]
    all_positions = torch.cat([where[label] for label in labels])
    example = torch.arange(n, device=device).repeat(len(labels))
    needed = int(query.max()) + 1  # positions after the last query reach no query
    points = []
    if model.can_resume(0):
        points = _resume_points(model, all_positions, needed, n, memory_budget)
    reach = query_reach(model)
    identity = same = restores = torch.zeros_like(all_positions, dtype=torch.bool)
    if corrupted is not None:
        corrupted = torch.as_tensor(corrupted, device=device)
        identity = before_corruption(all_positions, batch.tokens, corrupted, example)
        same = same_token(all_positions, batch.tokens, corrupted, example)
        restores = only_difference(all_positions, batch.tokens, corrupted, example)
    local_identity = identity | same
    token_local = set(token_local_sites(model))
    windows = window_local_sites(model) if corrupted is not None else {}
    refs = select_sites(model, layers, sites)
    runs = {}  # site name -> the cells that change its query's logits
    for ref in refs:
        reaches = reaches_query(ref, all_positions, query[example], reach)
        skip = local_identity if ref.name in token_local else identity
        if ref.name in windows:
            tokens, width = batch.tokens, windows[ref.name]
            skip = identity | same_window(all_positions, tokens, corrupted, example, width)
        runs[ref.name] = reaches & ~skip
    alike = [name for name in query_alike_sites(model) if name in runs] if alike else []
    before_query = all_positions < query[example]
    plans = []
    for ref in refs:
        copied, copy_from = _copies(ref, runs, alike, before_query, same)
        clean = torch.zeros_like(before_query)
        if ref.name == "layers.0.block_input":  # the whole input is then the clean one
            clean = runs[ref.name] & restores
            copied &= ~clean
        live = (runs[ref.name] & ~copied & ~clean).nonzero()[:, 0]
        restored = clean.nonzero()[:, 0]
        starts = torch.zeros_like(live)
        if points:
            table = torch.tensor(points, device=device)
            starts = table[torch.searchsorted(table, all_positions[live], right=True) - 1]
        first = ref.layer + 1 if ref.short in AFTER_MIXER else ref.layer
        copied = copied.nonzero()[:, 0]
        plans.append(SiteCells(ref, first, live, starts, copied, restored, copy_from))
    chunk = max(1, memory_budget // _bytes_per_row(model, length))
    return GridPlan(labels, all_positions, example, needed, points, chunk, plans, memory_budget)
