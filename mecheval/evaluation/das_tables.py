"""The report's DAS section: IIA against the subspace size k, and k*, the smallest k at which the
association lives.

    das_results(results)   every finished run's das.parquet (`mecheval das`), with the task
                           setting of its run
    iia_table(das)         IIA per model, corruption, layer, site, position and k, with a 95%
                           bootstrap interval over documents (and over seeds, where a model ran
                           with several)
    k_star_table(das)      per model, corruption, layer, site and position: the full swap's IIA,
                           k* (the smallest k reaching KSTAR_SHARE of it) and its interval

The intervals come from the same draws for every k of a (model, site, position), so k* is
recomputed in each draw: its interval says how sure the smallest sufficient k is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from mecheval.interventions.bootstrap import resample_weights
from mecheval.run_folder.files import DAS, read_table

KSTAR_SHARE = 0.9  # k* reaches this share of the full swap's IIA
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
    """(..., K) IIA with the full swap last -> (...) the smallest k reaching KSTAR_SHARE of it."""
    reached = iia >= KSTAR_SHARE * iia[..., -1:]
    return ks[reached.argmax(-1)]


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
        k_stars = _k_star(drawn, ks)
        low = np.percentile(k_stars, 2.5, method="lower")
        high = np.percentile(k_stars, 97.5, method="higher")
        full = correct[:, -1].mean()
        rows.append(
            {
                **key,
                "width": int(ks[-1]),
                "full_swap_iia": full,
                "k_star": int(_k_star(correct.mean(0), ks)),
                "k_star_low": int(low),
                "k_star_high": int(high),
                "runs": part["run"].nunique(),
            }
        )
    return pd.DataFrame(rows)
