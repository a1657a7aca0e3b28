"""The plan of an interchange grid: which cells run, where each restarts, how they are chunked.

    plan = plan_grid(model, batch, positions=["all"])
    plan.summary()   # per site: cells, run, copied, restored, first block, forwards, positions

`interchange_grid` runs a plan (mecheval.interventions.grid). A cell is one (site, position
label, document); cells are stacked label-major, so cell i patches document example[i] at
position positions[i]. Each rule a plan applies (positions after the last query: `needed`;
cells that cannot reach the query: `reaches_query`; identity patches: `before_corruption`,
`same_token`, `same_window`; restored cells: `only_difference`; copied cells:
`query_alike_sites`; resume points: `points`; chunks: `chunk`) is written out once, in
docs/interventions.md, "How the grid runs".
"""

from __future__ import annotations

import math
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


# Head inputs whose logits the metrics form at a time (mecheval.interventions.grid.Metrics):
# (256, V) stays in cache through the log-sum-exp's passes (20% faster on CPU than 1280 rows
# at once at the study's vocabulary); fewer when a patched forward holds fewer rows.
METRIC_ROWS = 256
# One part in this many of the memory budget is left to what the plan does not count: the
# allocator's slack, the reads of the run patched that make its contexts, the tables of results (a
# GPT-2-small-sized grid at 128 MiB peaked 1.5% over it without this: docs/pretrained.md).
UNCOUNTED = 8
# Floats one position of one row holds in a forward, in units of d_model: a generous bound on
# a block's activations (its MLP's hidden layer 4 d, attention's queries, keys and values 3 d,
# a mixer's expanded inputs 2-4 d, each kept for the next op).
ACTIVATION_WIDTHS = 32


def _bytes_per_row(model, length: int) -> int:
    """A generous estimate of the memory one stacked row of a patched forward over `length`
    positions takes: its activations, the mixers' contexts it carries (H3's generating state,
    25x larger, is never held) and its row of logits in the metrics."""
    d, vocab = model.config.d_model, model.config.vocab_size
    return 4 * (length * ACTIVATION_WIDTHS * d + model.context_size(length) + vocab)


def site_widths(model, refs, tokens: torch.Tensor) -> dict[str, int]:
    """Each site's width (a state's flattened size), from one forward of one token."""
    at = torch.zeros(1, 1, dtype=torch.long, device=tokens.device)
    reads = {r.name: (at if r.short == "state" else None) for r in refs}
    with torch.no_grad(), model.intervene(reads=reads) as record:
        model.forward_from(0, model.embed(tokens[:1, :1]), head=False)
    return {r.name: int(math.prod(record[r.name].shape[2:])) for r in refs}


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


def base_reads(refs) -> list[str]:
    """The sites of the unpatched run of the patched documents (the corrupted run in the
    interchange grid) that the grid's patched runs restart from (run_plan reads them at every
    position): the residual stream entering each site's block, a block's output for the sites
    after its mixer (their cells restart at the next block), its mixer's output for those
    after its MLP's input."""
    shorts = {(r.layer, r.short) for r in refs}
    names = {f"layers.{i}.block_input" for i, short in shorts if short != "block_output"}
    names |= {f"layers.{i}.block_output" for i, short in shorts if short in AFTER_MIXER}
    names |= {f"layers.{i}.mixer_output" for i, short in shorts if short in AFTER_MLP_INPUT}
    return sorted(names)


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
    first block's input there gives the corrupted run the clean document's input)."""
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
class GridMemory:
    """What an interchange grid holds in memory, in bytes (generous estimates), beside the
    chunks of patched rows the plan sizes to fit what is left of the budget.

    Attributes:
        clean: the clean run's value at every site of the grid at each cell's position, held
            through the grid (P n rows, each its site's width).
        corrupted: the corrupted run's reads at every position that patched runs restart from
            (`base_reads`: n x needed x d_model each), held through the grid.
        contexts: the corrupted run's mixer contexts at the resume points, and the gathered
            ones run_plan keeps for its chunks (at most a quarter of the budget): 0 without
            points.
        clean_run: the peak of the clean run, before the corrupted run: its reads of every
            site at every position, its activations, and `clean`.
        per_row: one stacked row of a patched forward (`_bytes_per_row`).
    """

    clean: int
    corrupted: int
    contexts: int
    clean_run: int
    per_row: int

    @property
    def held(self) -> int:
        """What every patched forward runs beside: the clean run's values, the corrupted
        run's reads and contexts."""
        return self.clean + self.corrupted + self.contexts

    @property
    def floor(self) -> int:
        """The least peak of the grid, however it is chunked (one row per patched forward):
        above the budget, the grid cannot keep it with this many documents at once."""
        return max(self.clean_run, self.held + self.per_row)


def _held_memory(
    model, refs, batch: Batch, labels: int, needed: int, budget: int
) -> tuple[int, int, int]:
    """(clean, corrupted, clean_run) bytes of GridMemory for `labels` positions per document."""
    n, length = batch.tokens.shape
    widths = site_widths(model, refs, batch.tokens)
    states = [r.name for r in refs if r.short == "state"]
    clean = 4 * labels * n * sum(widths.values())
    corrupted = 4 * n * needed * model.config.d_model * len(base_reads(refs))
    ordinary = sum(w for name, w in widths.items() if name not in states)
    # The clean run records its ordinary sites at every position of a block of documents, and
    # a block's scan may form every state of one layer (grid.py's _clean_values).
    block = clean_run_block(model, n, length, labels, budget) if states else n
    clean_run = clean + 4 * block * length * ordinary + block * _bytes_per_row(model, length)
    if states:
        clean_run += 4 * block * length * max(model.layer_state_sizes(length))
    return clean, corrupted, clean_run


def clean_run_block(model, n: int, length: int, labels: int, budget: int) -> int:
    """Documents per pass of a grid's clean run that reads the states at each row's
    `labels` patched positions: as many as keep the states read, and every state of one
    layer's scan over them (a scan may form them all), within half the budget; at least 1."""
    sizes = model.layer_state_sizes(length)
    per_document = 4 * (labels * sum(sizes) + length * max(sizes))
    return max(1, min(n, (budget // 2) // per_document))


def documents_per_call(
    model, batch: Batch, layers=None, sites=None, positions=None, *, memory_budget: int = 1 << 30
) -> int:
    """The most documents (rows) of `batch` one `interchange_grid` call of these arguments may
    take for its floor (`GridMemory.floor`, which grows with the documents) to stay within
    half of `memory_budget`, leaving the other half to its chunks; at least 1."""
    plan = plan_grid(model, batch, layers, sites, positions, memory_budget=memory_budget)
    per_document = max(1, (plan.memory.floor - plan.memory.per_row) // len(batch))
    room = memory_budget // 2 - plan.memory.per_row
    return int(min(len(batch), max(1, room // per_document)))


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
    memory: GridMemory  # what the grid holds beside its chunks
    metric_rows: int = METRIC_ROWS  # head inputs whose logits are formed at a time (<= chunk)

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
    # same token, the patched mixer output makes the block's output the clean run's there.
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
    refs = select_sites(model, layers, sites)
    held = _held_memory(model, refs, batch, len(labels), needed, memory_budget)
    clean_values, corrupted_reads, clean_run = held
    points = []
    if model.can_resume(0):  # contexts kept at the points within half of what is left
        left = memory_budget - memory_budget // UNCOUNTED - clean_values - corrupted_reads
        points = _resume_points(model, all_positions, needed, n, left)
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
    contexts = sum(4 * n * model.context_size(p) for p in points)
    contexts += memory_budget // 4 if points else 0  # (run_plan's gathered contexts)
    per_row = _bytes_per_row(model, needed)
    memory = GridMemory(clean_values, corrupted_reads, contexts, clean_run, per_row)
    chunk = max(1, (memory_budget - memory_budget // UNCOUNTED - memory.held) // memory.per_row)
    metric_rows = min(METRIC_ROWS, chunk)
    return GridPlan(
        labels, all_positions, example, needed, points, chunk, plans, memory_budget, memory,
        metric_rows,
    )  # fmt: skip
