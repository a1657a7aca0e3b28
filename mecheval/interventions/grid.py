"""`interchange_grid`: every (layer, site, position) interchange intervention of a model on a
set of documents, in a few batched forward passes.

For each cell the corrupted document (the base) runs with one activation (one layer, one site,
one position) replaced by the value the original document (the source) has there, and we read
the probability of the original answer at the query position (docs/study.md, "The metric").

How it is fast, and still exact:
- source activations are read once, for every site at every position, in one forward pass;
- the base's residual stream entering each layer is cached from one more forward pass, so a
  cell at layer l restarts at layer l instead of at the embedding;
- all cells of one site (every position, every example) are stacked along the batch axis and
  run together, in chunks that keep memory under `memory_budget` bytes;
- causality prunes the work: positions after the last query are never computed, and a cell whose
  patch cannot reach its row's query (a position after the query; the state after the query; a
  site after the last layer's mixer, which acts on each position alone, anywhere but at the
  query) is not run: its result is the corrupted run's, exactly;
- a patch of a block's output restarts at the next block, which reads exactly that tensor;
- when every mixer from the restart layer on is resumable (every mixer of the zoo: see
  mecheval.layers.resume), a cell also restarts near its position: cells are bucketed by
  position, and a bucket starting at s runs only positions s.. from the base run's mixer
  contexts at s (computed once, by running the base in segments), since the patched run equals
  the base run before the patched position;
- only the query position's logits are computed, and the KL and the answer's probability come
  from one log-sum-exp per row;
- `state` sites (the recurrent state after a position) restart the scan from the patched
  state through the kernels' initial_state (see mecheval.layers.sites.StateSite).
Each cell equals one plain per-cell forward with a hook (see `per_cell_loop`), to float
rounding; the tests check every cell.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mecheval.interventions.positions import expand_positions, resolve_position
from mecheval.layers.resume import Resume
from mecheval.tasks import Batch

COLUMNS = (
    "example",
    "layer",
    "site",
    "position",
    "position_index",
    "p_original",
    "p_corrupted",
    "p_restored",
    "logit_restored",
    "kl",
)


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


def logits_at(model, layer: int, residual: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """(B, V) logits at each row's query position, running blocks layer.. on `residual`."""
    return model.forward_from(layer, residual, positions=query)


def _bytes_per_row(model, length: int) -> int:
    """A generous estimate of the memory one stacked row of a patched forward takes."""
    d = model.config.d_model
    return 4 * length * (32 * d + model.state_size(length)) + 8 * model.config.vocab_size


# Sites after a block's mixer: from there on the block (residual add, MLP) and, after the last
# block, the final norm and the head act on each position alone.
AFTER_MIXER = frozenset({"mixer_output", "mlp_input", "mlp_output", "block_output"})


@dataclass(frozen=True)
class Clean:
    """The clean run's distribution at the query, as the metrics need it: probs (n, V) and
    neg_entropy (n,) = sum_v p log p."""

    probs: torch.Tensor
    neg_entropy: torch.Tensor

    @staticmethod
    def of(logits: torch.Tensor) -> Clean:
        log_p = F.log_softmax(logits.float(), dim=-1)
        probs = log_p.exp()
        return Clean(probs, (probs * log_p).sum(-1))

    def rows(self, rows: torch.Tensor) -> Clean:
        return Clean(self.probs[rows], self.neg_entropy[rows])


def _metrics(logits: torch.Tensor, answers: torch.Tensor, clean: Clean):
    """(p of the answer, the answer's logit, KL(clean || patched)) per row.

    KL = sum p log p - sum p (logits - lse) = neg_entropy - <p, logits> + lse, as sum p = 1:
    one log-sum-exp and one dot product per row instead of a log-softmax over the vocabulary.
    """
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    logit = logits.gather(1, answers[:, None])[:, 0]
    dot = (clean.probs[:, None, :] @ logits[:, :, None])[:, 0, 0]
    kl = (clean.neg_entropy - dot + lse).clamp_min(0.0)
    return (logit - lse).exp(), logit, kl


def reaches_query(ref: SiteRef, positions: torch.Tensor, query: torch.Tensor, last_layer: int):
    """Rows whose patch at `positions` can change the logits at their `query` (causality)."""
    if ref.short == "state":  # the state after p feeds positions p + 1 on
        return positions < query
    if ref.layer == last_layer and ref.short in AFTER_MIXER:
        return positions == query
    return positions <= query


# Cells are bucketed by position into at most this many resume points: each bucket is one more
# forward per site, each point more positions skipped (8 was fastest on CPU at the study's shape,
# between 4 and 40, for attention, Mamba and DeltaNet).
MAX_RESUME_POINTS = 8


def _resumable(model, layer: int) -> bool:
    return all(getattr(block.mixer, "resumable", False) for block in model.layers[layer:])


def _resume_points(model, positions: torch.Tensor, needed: int, n: int, budget: int) -> list[int]:
    """Where resumed runs may start: multiples of a stride that keep the buckets few, kept only
    while the contexts stored there (n rows each) fit in half the memory budget."""
    stride = max(1, -(-needed // MAX_RESUME_POINTS))
    points = sorted({int(p) // stride * stride for p in positions.unique().tolist()})
    points = [p for p in points if 0 <= p < needed]
    context_bytes = sum(4 * n * model.context_size(p) for p in points)
    return points if context_bytes <= budget // 2 else []


@contextmanager
def _resuming(model, first_layer: int, contexts: list[Resume]):
    """Mixers of layers first_layer.. continue from `contexts` (one per such layer)."""
    mixers = [block.mixer for block in model.layers[first_layer:]]
    for mixer, context in zip(mixers, contexts, strict=True):
        mixer.resume = context
    try:
        yield
    finally:
        for mixer in mixers:
            mixer.resume = None


def _base_contexts(model, embedded: torch.Tensor, points: list[int]) -> dict[int, list[Resume]]:
    """point -> every layer's mixer context after the base run's positions [0, point), from one
    pass over the base in segments."""
    contexts: dict[int, list[Resume]] = {0: [Resume() for _ in model.layers]}
    current = [Resume() for _ in model.layers]
    rows = torch.zeros(embedded.shape[0], dtype=torch.long, device=embedded.device)
    previous = 0
    for point in [p for p in points if p > 0]:
        with _resuming(model, 0, current):
            model.forward_from(0, embedded[:, previous:point], positions=rows)
        contexts[point] = [Resume(c.state) for c in current]
        previous = point
    return contexts


@torch.no_grad()
def interchange_grid(
    model,
    batch: Batch,
    corrupted: torch.Tensor,
    layers=None,
    sites=None,
    positions=None,
    *,
    memory_budget: int = 1 << 30,
    progress: bool = False,
) -> pd.DataFrame:
    """Run the interchange interventions of a grid of cells.

    Args:
        model: a `mecheval.models` model.
        batch: the original documents (the source), a task `Batch` of n documents.
        corrupted: (n, L) the counterfactual tokens (the base), e.g. `task.corrupt(batch, ...)`.
        layers: layer indices (default all).
        sites: short site names such as "block_input" or "state" (default all of the model's).
        positions: position specs (default "key", "value", "divider", "query"); "all" means
            every position; see mecheval.interventions.positions.
        memory_budget: bytes the stacked forward passes may use; larger grids are chunked.
        progress: show a progress bar over sites.

    Returns:
        a DataFrame with a row per (example, layer, site, position) and columns `COLUMNS`:
        probabilities of the original answer at the query position in the clean run
        (p_original), the corrupted run (p_corrupted) and the patched run (p_restored), the
        answer's logit in the patched run, and KL(clean || patched) over the vocabulary.
    """
    device = next(model.parameters()).device
    if not isinstance(batch, Batch):
        raise TypeError(f"batch must be a mecheval.tasks.Batch, got {type(batch).__name__}")
    if len(batch) == 0:
        raise ValueError("batch is empty: interchange_grid needs at least one document")
    batch = batch.to(device)
    base_tokens = torch.as_tensor(corrupted, device=device)
    if base_tokens.shape != batch.tokens.shape:
        expected, got = tuple(batch.tokens.shape), tuple(base_tokens.shape)
        raise ValueError(f"corrupted must have the batch's shape {expected}, got {got}")
    vocab = model.config.vocab_size
    for name, ids in (
        ("batch.tokens", batch.tokens),
        ("batch.answers", batch.answers),
        ("corrupted", base_tokens),
    ):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(
                f"{name} holds token ids in [{low}, {high}], outside the model's vocabulary "
                f"0..{vocab - 1} (vocab_size {vocab}): the model was built for another task"
            )
    was_training = model.training
    model.eval()
    n, length = batch.tokens.shape
    refs = select_sites(model, layers, sites)
    labels = expand_positions(positions, length)
    where = {label: resolve_position(label, batch) for label in labels}
    query, answers = batch.positions["query"], batch.answers
    rows = torch.arange(n, device=device)

    ordinary = [r for r in refs if r.short != "state"]
    with model.intervene(reads={r.name: None for r in ordinary}) as record:
        clean = logits_at(model, 0, model.embed(batch.tokens), query)
    source = {r.name: record[r.name] for r in ordinary}
    # Every cell of a site, stacked label-major: its example and its position.
    all_positions = torch.cat([where[label] for label in labels])  # (P n,)
    example = rows.repeat(len(labels))
    states = [r for r in refs if r.short == "state"]
    if states and 4 * n * length * model.state_size(length) <= memory_budget // 2:
        # The state after every position, in one pass (one scan piece per position), then
        # the patched positions picked out.
        with model.intervene(reads={r.name: None for r in states}) as record:
            model.forward_from(0, model.embed(batch.tokens), positions=query)
        source.update({r.name: record[r.name][example, all_positions] for r in states})
    elif states:
        # Too many to keep: the state after each patched position, in one pass over the
        # stacked labels (one scan piece per distinct position, over P n rows).
        tokens = batch.tokens.repeat(len(labels), 1)
        with model.intervene(reads={r.name: all_positions for r in states}) as record:
            model.forward_from(0, model.embed(tokens), positions=query.repeat(len(labels)))
        source.update({r.name: record[r.name] for r in states})

    restart_layers = sorted({r.layer for r in refs if r.short != "block_output"})
    output_layers = sorted({r.layer for r in refs if r.short == "block_output"})
    reads = {f"layers.{i}.block_input": None for i in restart_layers}
    reads.update({f"layers.{i}.block_output": None for i in output_layers})
    base_embedded = model.embed(base_tokens)
    with model.intervene(reads=reads) as record:
        corrupt_logits = logits_at(model, 0, base_embedded, query)
    # Where each site's cells restart, and the base's residual stream entering there.
    base_inputs = {(i, False): record[f"layers.{i}.block_input"] for i in restart_layers}
    base_inputs.update({(i, True): record[f"layers.{i}.block_output"] for i in output_layers})

    clean_dist = Clean.of(clean)
    p_original = _metrics(clean, answers, clean_dist)[0]
    corrupt = _metrics(corrupt_logits, answers, clean_dist)
    p_corrupted = corrupt[0]

    chunk = max(1, memory_budget // _bytes_per_row(model, length))
    needed = int(query.max()) + 1  # positions after the last query reach no query
    label_index = torch.arange(len(labels), device=device).repeat_interleave(n)
    last_layer = len(model.layers) - 1
    points = []
    if _resumable(model, 0):
        points = _resume_points(model, all_positions, needed, n, memory_budget)
    contexts = _base_contexts(model, base_embedded, points) if points else {}
    outputs = []
    for ref in tqdm(refs, disable=not progress, desc="interchange grid", unit="site"):
        if ref.short == "state":
            values = source[ref.name]  # (P n, ...) already stacked by label
        else:
            values = source[ref.name][example, all_positions]  # (P n, C)
        # Cells that cannot reach the query keep the corrupted run's results.
        restored, logit, kl = (m[example].clone() for m in corrupt)
        live = reaches_query(ref, all_positions, query[example], last_layer).nonzero()[:, 0]
        is_output = ref.short == "block_output"
        layer = ref.layer + 1 if is_output else ref.layer  # the first block to run
        residual = base_inputs[(ref.layer, is_output)][:, :needed]
        # Bucket the cells by resume point (one bucket at 0 when the model cannot resume).
        starts = torch.zeros_like(live)
        if points:
            table = torch.tensor(points, device=device)
            starts = table[torch.searchsorted(table, all_positions[live], right=True) - 1]
        for start_point in starts.unique().tolist():
            bucket = live[starts == start_point]
            for first in range(0, len(bucket), chunk):
                cells = bucket[first : first + chunk]
                rows_part = example[cells]
                at, q_at = all_positions[cells] - start_point, query[rows_part] - start_point
                suffix = residual[rows_part, start_point:]
                resumed = [c.rows(rows_part) for c in contexts.get(start_point, [])[layer:]]
                with _resuming(model, layer, resumed) if start_point else nullcontext():
                    if is_output:  # the next block reads exactly the patched output
                        patched = suffix.index_put(
                            (torch.arange(len(cells), device=device), at), values[cells]
                        )
                        logits = logits_at(model, layer, patched, q_at)
                    else:
                        with model.intervene(patches={ref.name: (at, values[cells])}):
                            logits = logits_at(model, layer, suffix, q_at)
                p, lg, k = _metrics(logits, answers[rows_part], clean_dist.rows(rows_part))
                restored[cells], logit[cells], kl[cells] = p, lg, k
        outputs.append((ref, restored, logit, kl))

    if was_training:
        model.train()
    return _frame(outputs, labels, example, label_index, all_positions, p_original, p_corrupted)


def _frame(
    outputs, labels, example, label_index, all_positions, p_original, p_corrupted
) -> pd.DataFrame:
    if not outputs:
        return pd.DataFrame({c: [] for c in COLUMNS})
    cpu = lambda t: t.detach().cpu().numpy()  # noqa: E731
    ex, lab, pos = cpu(example), cpu(label_index), cpu(all_positions)
    p_orig, p_corr = cpu(p_original)[ex], cpu(p_corrupted)[ex]
    label_names = np.asarray(labels, dtype=object)
    parts = []
    for ref, restored, logit, kl in outputs:
        parts.append(
            pd.DataFrame(
                {
                    "example": ex,
                    "layer": ref.layer,
                    "site": ref.short,
                    "position": label_names[lab],
                    "position_index": pos,
                    "p_original": p_orig,
                    "p_corrupted": p_corr,
                    "p_restored": cpu(restored),
                    "logit_restored": cpu(logit),
                    "kl": cpu(kl),
                }
            )
        )
    return pd.concat(parts, ignore_index=True)[list(COLUMNS)]
