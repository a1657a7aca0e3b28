"""Bootstrap intervals for Attrib: how much a cell's score moves when the documents (and, where a
cell pools several runs, the runs) are drawn again.

Attrib is a ratio of means over documents, so its interval comes from resampling documents
with replacement and recomputing the ratio, `reps` times. With `cluster` (e.g. "run" when a cell
pools several seeds) the resampling is hierarchical: runs are drawn with replacement, then
documents within each drawn run. Every cell of a model shares the same draws.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from mecheval.interventions.metric import CELL, attrib, model_keys


def resample_weights(
    sizes: list[int], reps: int, rng: np.random.Generator, clustered: bool
) -> np.ndarray:
    """(reps, sum(sizes)) weights: how often each row is drawn in each replicate.

    Args:
        sizes: rows per cluster (one cluster when not clustered).
        clustered: draw clusters with replacement first, then rows within each cluster.
    """
    if not clustered:
        n = sum(sizes)
        return rng.multinomial(n, np.full(n, 1.0 / n), size=reps).astype(np.float64)
    clusters = rng.multinomial(len(sizes), np.full(len(sizes), 1.0 / len(sizes)), size=reps)
    parts = [
        clusters[:, [c]] * rng.multinomial(size, np.full(size, 1.0 / size), size=reps)
        for c, size in enumerate(sizes)
    ]
    return np.concatenate(parts, axis=1).astype(np.float64)


def attrib_intervals(
    df: pd.DataFrame,
    reps: int = 1000,
    level: float = 0.95,
    seed: int = 0,
    cluster: str | None = None,
    min_effect: float = 0.01,
) -> pd.DataFrame:
    """`attrib(df)` with a bootstrap interval per cell: columns attrib_low, attrib_high.

    Args:
        df: an interchange-grid table (with model-key columns if several models are in it).
        reps: bootstrap replicates.
        level: coverage of the (percentile) interval.
        seed: seed of the resampling.
        cluster: a column whose levels are resampled too (e.g. "run" to pool seeds); it is
            not a model key: the point estimate pools its levels (ratio of pooled means).
        min_effect: as in `attrib` (models whose corruption does nothing are dropped).
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    if cluster is not None and cluster not in df:
        raise ValueError(f"cluster column {cluster!r} is not in the grid table")
    pooled = df.drop(columns=[cluster]) if cluster else df
    table = attrib(pooled, min_effect=min_effect)
    keys = [k for k in model_keys(df) if k != cluster]
    rng = np.random.default_rng(seed)
    tail = (1 - level) / 2
    bounds = []
    models = df.groupby(keys, sort=False, dropna=False) if keys else [((), df)]
    for key, part in models:
        rows = [cluster, "example"] if cluster else ["example"]
        restored = part.pivot_table(
            index=rows, columns=list(CELL), values="p_restored", aggfunc="mean"
        )
        per_row = part.groupby(rows, sort=True)[["p_original", "p_corrupted"]].mean()
        per_row = per_row.loc[restored.index]
        # Rows are sorted by (cluster, example): each cluster's rows are contiguous.
        sizes = per_row.groupby(level=0).size().tolist() if cluster else [len(per_row)]
        w = resample_weights(sizes, reps, rng, clustered=cluster is not None)
        total = w.sum(axis=1, keepdims=True)
        r = (w @ restored.to_numpy(dtype=np.float64, na_value=np.nan)) / total
        c = (w @ per_row["p_corrupted"].to_numpy()) / total[:, 0]
        o = (w @ per_row["p_original"].to_numpy()) / total[:, 0]
        with np.errstate(divide="ignore", invalid="ignore"):
            scores = (r - c[:, None]) / (o - c)[:, None]
        low, high = np.nanquantile(scores, [tail, 1 - tail], axis=0)
        cells = restored.columns.to_frame(index=False)
        key = key if isinstance(key, tuple) else (key,)
        for name, value in zip(keys, key, strict=True):
            cells[name] = value
        cells["attrib_low"], cells["attrib_high"] = low, high
        bounds.append(cells)
    return table.merge(pd.concat(bounds, ignore_index=True), on=[*keys, *CELL], how="left")
