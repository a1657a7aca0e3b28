"""Mean and resample ablation: one activation of the clean document (one layer, site and
position) replaced by its mean over the documents, or by its value in another document, and
the answer's probability read at the query. The same engine as the interchange grid
(`plan_grid`, `run_plan`): a cell restarts at its block and near its position, cells are
batched, and a cell that cannot reach its query is not run. The patched documents are the
clean ones, so `p_corrupted` is `p_original`; the effect of a cell is p_original - p_restored.

Means are taken over the documents at each position label (the key of each document, for
"key"), so documents of different layouts ablate like for like; a resample draws for each
document another document of the batch (one seeded derangement, the same for every site, so
that the values patched at two sites come from one run).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from mecheval.interventions.grid import check_vocabulary, frame, run_plan
from mecheval.interventions.plan import plan_grid
from mecheval.tasks import Batch

KINDS = ("mean", "resample")


def derangement(n: int, seed: int) -> torch.Tensor:
    """(n,) a permutation of 0..n-1 with no fixed point (n >= 2), seeded."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)
    return torch.from_numpy(np.roll(order, 1)[np.argsort(order)])


@torch.no_grad()
def ablation_grid(
    model,
    batch: Batch,
    kind: str = "mean",
    layers=None,
    sites=None,
    positions=None,
    *,
    seed: int = 0,
    memory_budget: int = 1 << 30,
    progress: bool = False,
) -> pd.DataFrame:
    """The mean or resample ablation of every cell (see the module docstring).

    Args:
        model, batch, layers, sites, positions, memory_budget, progress: as
            `interchange_grid` takes them (no corrupted documents: the run patched is the
            clean one).
        kind: "mean" or "resample".
        seed: the resample's derangement.

    Returns:
        the grid's columns (`COLUMNS`), p_restored the answer's probability after the ablation.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if len(batch) < 2:
        raise ValueError("an ablation needs at least 2 documents (a mean, another document)")
    device = next(model.parameters()).device
    batch = batch.to(device)
    check_vocabulary(model, batch, batch.tokens)
    was_training = model.training
    model.eval()
    # A mean of one site's values is no value another site's run computes: the query-alike
    # sites' cells run each (a resample's values are another run's, alike at every site).
    plan = plan_grid(
        model, batch, layers, sites, positions, memory_budget=memory_budget, alike=kind != "mean"
    )
    n = len(batch)
    other = derangement(n, seed).to(device)

    def values(clean_values: dict) -> dict:
        out = {}
        for name, stacked in clean_values.items():
            per_label = stacked.view(-1, n, *stacked.shape[1:])  # (P, n, ...)
            if kind == "mean":
                per_label = per_label.mean(1, keepdim=True).expand_as(per_label)
            else:
                per_label = per_label[:, other]
            out[name] = per_label.reshape(stacked.shape)
        return out

    try:
        outputs, p_original, p_unpatched = run_plan(
            model, plan, batch, batch.tokens, progress, values
        )
    finally:
        model.train(was_training)
    return frame(outputs, plan, p_original, p_unpatched)
