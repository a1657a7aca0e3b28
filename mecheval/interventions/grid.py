"""`interchange_grid`: every (layer, site, position) interchange intervention of a model on a
set of documents, in a few batched forward passes.

Each cell runs the corrupted document with one activation (one layer, one site, one position)
set to the clean document's value there, and reads the probability of the clean answer at the
query (docs/study.md, "The metric"). `plan_grid` (mecheval.interventions.plan) decides which
cells run, where each restarts and how they are chunked; this module runs the plan. Each cell
equals one plain per-cell forward with a hook (`per_cell_loop`), to float rounding; the tests
check every cell. What the plan skips and shares, and why each is exact: docs/interventions.md,
"How the grid runs".
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from mecheval.interventions.engine import (
    Contexts,
    Metrics,
    block_output_at,
    corrupted_run,
    hidden_at,
    run_patched,
)
from mecheval.interventions.plan import (
    AFTER_MIXER,
    AFTER_MLP_INPUT,
    CELL_COLUMNS,
    GridPlan,
    check_batch,
    clean_run_block,
    plan_grid,
    select_sites,
)
from mecheval.tasks import Batch

__all__ = ["COLUMNS", "frame", "interchange_grid", "plan_grid", "run_plan", "select_sites"]

COLUMNS = (*CELL_COLUMNS, "p_original", "p_corrupted", "p_restored", "logit_restored", "kl")


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
        batch: the clean documents, a task `Batch` of n documents.
        corrupted: (n, L) the counterfactual tokens (the corrupted documents, the ones patched),
            e.g. `task.corrupt(batch, ...)`.
        layers: layer indices (default all).
        sites: short site names such as "block_input" or "state" (default all of the model's).
        positions: position specs (default "key", "value", "divider", "query"); "all" means
            every position; see mecheval.interventions.positions.
        memory_budget: bytes the stacked forward passes may use; larger grids are chunked.
        progress: show a progress bar over sites.

    Returns:
        a DataFrame with a row per (example, layer, site, position) and columns `COLUMNS`:
        probabilities of the clean answer at the query position in the clean run
        (p_original), the corrupted run (p_corrupted) and the patched run (p_restored), the
        answer's logit in the patched run, and KL(clean || patched) over the vocabulary.
    """
    check_batch(batch)
    device = next(model.parameters()).device
    batch = batch.to(device)
    corrupted = torch.as_tensor(corrupted, device=device)
    if corrupted.shape != batch.tokens.shape:
        expected, got = tuple(batch.tokens.shape), tuple(corrupted.shape)
        raise ValueError(f"corrupted must have the batch's shape {expected}, got {got}")
    check_vocabulary(model, batch, corrupted)
    was_training = model.training
    model.eval()
    plan = plan_grid(
        model, batch, layers, sites, positions, corrupted=corrupted, memory_budget=memory_budget
    )
    try:
        outputs, p_original, p_corrupted = run_plan(model, plan, batch, corrupted, progress)
    finally:
        model.train(was_training)
    return frame(outputs, plan, p_original, p_corrupted)


def check_vocabulary(model, batch: Batch, corrupted: torch.Tensor) -> None:
    vocab = model.config.vocab_size
    for name, ids in (
        ("batch.tokens", batch.tokens),
        ("batch.answers", batch.answers),
        ("corrupted", corrupted),
    ):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(
                f"{name} holds token ids in [{low}, {high}], outside the model's vocabulary "
                f"0..{vocab - 1} (vocab_size {vocab}): the model was built for another task"
            )


def _clean_values(model, plan: GridPlan, batch: Batch) -> tuple[dict, torch.Tensor]:
    """The clean run's values at every site, stacked like the cells ((P n, ...): cell i's
    value at its document and position), and its head input at the query. The clean run reads
    each row's patched positions in one pass (a scan returns the states there), over blocks
    of documents whose state reads fit the budget (`clean_run_block`)."""
    n, length = batch.tokens.shape
    query, labels = batch.positions["query"], len(plan.labels)
    at = plan.positions.view(labels, n).T  # (n, P): cells are label-major
    names = [s.ref.name for s in plan.sites]
    states = [s.ref.name for s in plan.sites if s.ref.short == "state"]
    block = clean_run_block(model, n, length, labels, plan.memory_budget) if states else n
    clean_values, clean = {}, []
    for start in range(0, n, block):
        rows = slice(start, min(n, start + block))
        reads = {name: at[rows] if name in states else None for name in names}
        with model.intervene(reads=reads) as record:
            clean.append(hidden_at(model, 0, model.embed(batch.tokens[rows]), query[rows]))
        for name in names:
            picked = record[name]  # (b, P, ...) for a state, else (b, L, ...) every position
            if name not in states:
                picked = picked[torch.arange(picked.shape[0], device=at.device)[:, None], at[rows]]
            if name not in clean_values:
                clean_values[name] = picked.new_empty(labels, n, *picked.shape[2:])
            clean_values[name][:, rows] = picked.transpose(0, 1)
    clean_values = {name: t.view(labels * n, *t.shape[2:]) for name, t in clean_values.items()}
    return clean_values, torch.cat(clean)


def run_plan(
    model, plan: GridPlan, batch: Batch, corrupted: torch.Tensor, progress: bool, values=None
):
    """Every live cell of the plan, patched into the documents `corrupted` (the corrupted
    ones, or the clean ones for an ablation) with the clean run's values at its site and
    position (`values`, given: a function of those, the stacked dict of the clean run's
    values, returning the values to patch): (per site: ref, p_restored, logit, kl),
    p_original, p_corrupted (the patched documents' run unpatched)."""
    query, answers = batch.positions["query"], batch.answers
    clean_values, clean = _clean_values(model, plan, batch)
    if values is not None:
        clean_values = values(clean_values)
    # The patched run's residual stream entering each block a site's cells restart at (the next
    # one for the sites after a mixer), and what a one-position run of a block needs.
    shorts = {(s.ref.layer, s.ref.short) for s in plan.sites}
    reads = {f"layers.{i}.block_input": None for i, short in shorts if short != "block_output"}
    reads.update({f"layers.{i}.block_output": None for i, sh in shorts if sh in AFTER_MIXER})
    reads.update({f"layers.{i}.mixer_output": None for i, sh in shorts if sh in AFTER_MLP_INPUT})
    corrupt_hidden, corrupted_reads, at_point = corrupted_run(
        model, model.embed(corrupted), query, reads, plan.points, plan.needed
    )

    metrics = Metrics.of(model, clean, plan.metric_rows)
    restored = metrics(clean, answers, None)
    p_original = restored[0]
    corrupt = metrics(corrupt_hidden, answers, None)
    contexts = Contexts(at_point, len(batch), plan.memory_budget // 4)
    outputs = []
    for site in tqdm(plan.sites, disable=not progress, desc="interchange grid", unit="site"):
        # Cells that do not run keep the corrupted run's results.
        results = tuple(m[plan.example].clone() for m in corrupt)
        for column, clean_column in zip(results, restored, strict=True):  # the clean run's
            column[site.restored] = clean_column[plan.example[site.restored]]
        site_values = clean_values[site.ref.name]
        _run_site(
            model, plan, site, site_values, corrupted_reads, contexts, metrics, batch, results
        )
        outputs.append((site.ref, *results))
    _copy_results(plan, outputs)
    return outputs, p_original, corrupt[0]


def _run_site(
    model, plan, site, values, corrupted_reads, contexts, metrics, batch, results
) -> None:
    """Run one site's live cells on the engine (`run_patched`), writing their (p_restored,
    logit, kl) into `results`."""
    ref, live = site.ref, site.live
    if not len(live):
        return
    is_output = ref.short in AFTER_MIXER  # restarts at the next block, on its output
    if ref.short != "block_output" and is_output:
        values = _block_outputs(model, ref, values, live, plan, corrupted_reads)
    entering = "block_output" if is_output else "block_input"
    residual = corrupted_reads[f"layers.{ref.layer}.{entering}"]
    rows = plan.example[live]
    hidden = run_patched(
        model,
        ref.name,
        site.first_block,
        residual,
        values[live],
        rows,
        plan.positions[live],
        site.starts,
        batch.positions["query"],
        contexts.rows,
        output=is_output,
        chunk=plan.chunk,
    )
    for column, value in zip(results, metrics(hidden, batch.answers[rows], rows), strict=True):
        column[live] = value


def _copy_results(plan: GridPlan, outputs: list) -> None:
    """Fill the copied cells of each site from the site they copy (a site copies from a later
    one, which may copy from one later still: last first)."""
    results = {out[0].name: out[1:] for out in outputs}
    for site, (_, *mine) in reversed(list(zip(plan.sites, outputs, strict=True))):
        if site.copy_from is not None:
            for column, theirs in zip(mine, results[site.copy_from], strict=True):
                column[site.copied] = theirs[site.copied]


def _block_outputs(
    model, ref, values: torch.Tensor, cells: torch.Tensor, plan, corrupted_reads: dict
):
    """(P n, d_model): at `cells`, the output of block ref.layer at the cell's position when
    the site after the block's mixer is patched there with `values` (`block_output_at`)."""
    rows, at = plan.example[cells], plan.positions[cells]
    mixer_output = None
    if ref.short in AFTER_MLP_INPUT:
        mixer_output = corrupted_reads[f"layers.{ref.layer}.mixer_output"][rows, at]
    x = corrupted_reads[f"layers.{ref.layer}.block_input"][rows, at]
    patched = block_output_at(model, ref, values[cells], x, mixer_output)
    outputs = x.new_zeros(len(plan.positions), x.shape[-1])
    outputs[cells] = patched
    return outputs


def frame(outputs, plan: GridPlan, p_original, p_corrupted) -> pd.DataFrame:
    """The grid's table from `run_plan`'s results."""
    if not outputs:
        return pd.DataFrame({c: [] for c in COLUMNS})
    cpu = lambda t: t.detach().cpu().numpy()  # noqa: E731
    n = len(plan.positions) // len(plan.labels)
    label_index = torch.arange(len(plan.labels)).repeat_interleave(n)
    ex, lab, pos = cpu(plan.example), cpu(label_index), cpu(plan.positions)
    labels = plan.labels
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
