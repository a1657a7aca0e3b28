"""The report's DAS section: IIA against the subspace size k, and k*, the smallest k at which the
association lives.

    das_results(results)   every finished run's das.parquet (`mecheval das`), with the task
                           setting of its run
    iia_table(das)         IIA per model, corruption, layer, site, position and k, with a 95%
                           bootstrap interval over documents (and over seeds, where a model ran
                           with several)
    k_star_table(das)      per model, corruption, layer, site and position: the IIA with no swap
                           and with the full swap, k* (the smallest k whose IIA reaches
                           KSTAR_SHARE of the full swap's gain over no swap) and its interval;
                           no k* where the full swap gains less than MIN_GAIN

The intervals come from the same draws for every k of a (model, site, position), so k* is
recomputed in each draw: its interval says how sure the smallest sufficient k is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from mecheval.interventions.bootstrap import resample_weights
from mecheval.run_folder.files import DAS, read_table

KSTAR_SHARE = 0.9  # k* reaches this share of the full swap's gain in IIA over no swap
MIN_GAIN = 0.1  # a full swap gaining less carries too little of the answer for a k*
MODEL = ["task", "setting", "arch", "d_model", "n_layers"]
CELL = ["corruption", "layer", "site", "position"]
REPS = 1000


def das_results(results: pd.DataFrame) -> pd.DataFrame:
    """The DAS tables of the runs of `results` (collect_results) that have one."""
    frames = []
    for run in results.itertuples():
        if (Path(run.path) / DAS).exists():
            table = read_table(run.path, DAS)
            frames.append(table.assign(setting=run.setting, seed=run.seed))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _draws(part: pd.DataFrame, seed: int = 0):
    """The (document, k) correctness matrix of one cell, the ks, and (REPS, documents) bootstrap
    weights (clustered by run where the cell pools several)."""
    wide = part.pivot_table(index=["run", "example"], columns="k", values="correct")
    wide = wide.dropna(axis=1)
    sizes = wide.groupby(level="run").size().tolist()
    weights = resample_weights(sizes, REPS, np.random.default_rng(seed), len(sizes) > 1)
    return wide.to_numpy(dtype=float), wide.columns.to_numpy(), weights


def _k_star(iia: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """(..., K) IIA, no swap (k = 0) first where measured and the full swap last -> (...) the
    smallest k > 0 reaching KSTAR_SHARE of the full swap's gain (NaN where it gains less than
    MIN_GAIN). Without a k = 0 column (tables from before it was measured) the gain is over 0."""
    unswapped = iia[..., :1] if ks[0] == 0 else np.zeros_like(iia[..., :1])
    swapped, sizes = (iia[..., 1:], ks[1:]) if ks[0] == 0 else (iia, ks)
    gain = swapped - unswapped
    reached = gain >= KSTAR_SHARE * gain[..., -1:]
    k_star = sizes[reached.argmax(-1)].astype(float)
    return np.where(gain[..., -1] >= MIN_GAIN, k_star, np.nan)


def _cells(das: pd.DataFrame):
    for key, part in das.groupby(MODEL + CELL, sort=True):
        yield dict(zip(MODEL + CELL, key, strict=True)), part


def iia_table(das: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for key, part in _cells(das):
        correct, ks, weights = _draws(part)
        iia = correct.mean(0)
        drawn = weights @ correct / weights.sum(1, keepdims=True)
        low, high = np.percentile(drawn, [2.5, 97.5], axis=0)
        for j, k in enumerate(ks):
            rows.append(
                {
                    **key,
                    "k": int(k),
                    "width": int(part["width"].iloc[0]),
                    "iia": iia[j],
                    "iia_low": low[j],
                    "iia_high": high[j],
                    "runs": part["run"].nunique(),
                    "documents": len(correct),
                }
            )
    return pd.DataFrame(rows)


def k_star_table(das: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for key, part in _cells(das):
        correct, ks, weights = _draws(part)
        drawn = weights @ correct / weights.sum(1, keepdims=True)
        iia = correct.mean(0)
        k_star = float(_k_star(iia, ks))
        k_stars = _k_star(drawn, ks)
        seen = k_stars[~np.isnan(k_stars)]
        low, high = np.nan, np.nan  # no k*: no interval either
        if not np.isnan(k_star):
            low = np.percentile(seen, 2.5, method="lower")
            high = np.percentile(seen, 97.5, method="higher")
        rows.append(
            {
                **key,
                "width": int(ks[-1]),
                "no_swap_iia": iia[0] if ks[0] == 0 else np.nan,
                "full_swap_iia": iia[-1],
                "k_star": k_star,
                "k_star_low": low,
                "k_star_high": high,
                "runs": part["run"].nunique(),
            }
        )
    table = pd.DataFrame(rows)
    sizes = ["k_star", "k_star_low", "k_star_high"]
    table[sizes] = table[sizes].astype("Int64")  # NaN (no k*) as <NA>
    return table
