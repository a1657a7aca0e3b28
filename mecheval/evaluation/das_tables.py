"""The report's DAS section: IIA against the subspace size k, and k*, the smallest k at which the
association lives.

    das_results(results, best)   the das.parquet (`mecheval das`) of the runs of the
                           configurations the report selected (each model's best learning
                           rate, every seed of it), with the settings they were searched with;
                           and notes naming what is left out
    iia_table(das)         IIA per model, DAS settings, corruption, layer, site, position and
                           k, with a 95% bootstrap interval over documents (and over seeds,
                           where a model ran with several): runs are pooled only where model,
                           learning rate and DAS settings are the same
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

from mecheval.evaluation.analysis import same_configuration
from mecheval.interventions.bootstrap import resample_weights
from mecheval.run_folder.files import DAS, DAS_STAMP, read_stamp, read_table

KSTAR_SHARE = 0.9  # k* reaches this share of the full swap's gain in IIA over no swap
MIN_GAIN = 0.1  # a full swap gaining less carries too little of the answer for a k*
# What runs pool over: the model, its learning rate and the settings DAS searched it with.
MODEL = ["task", "setting", "arch", "d_model", "n_layers", "lr", "das_settings"]
CELL = ["corruption", "layer", "site", "position"]
REPS = 1000
# The stamp's settings that label a DAS (those that change its results; the checkpoint is the
# run's own, and sites, layers and positions are cells of their own).
LABELLED = ("steps", "lr", "batch_size", "holdout", "seed", "split", "dims")


def das_settings(run_dir: str | Path) -> str:
    """The settings a run's DAS was searched with, as a label ("steps 200, lr 0.01, ...")."""
    settings = read_stamp(Path(run_dir), DAS_STAMP).get("settings") or {}
    parts = []
    for name in LABELLED:
        value = settings.get(name)
        if isinstance(value, list):
            value = ",".join(map(str, value))
        parts.append(f"{name} {'default' if value is None else value}")
    return ", ".join(parts) if settings else "not recorded"


def das_results(results: pd.DataFrame, best: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """(the DAS tables of the runs of `best`'s configurations (every seed of each selected
    model's learning rate: analysis.same_configuration) that have one, with their setting,
    seed and das_settings; notes naming what the report leaves out: DAS of runs of other
    learning rates, and the sizes k each DAS left out at a site narrower than k)."""
    selected = set()
    for _, run in best.iterrows():
        selected |= set(same_configuration(run, results)["run"])
    frames, others, narrow = [], [], {}
    for run in results.itertuples():
        if not (Path(run.path) / DAS).exists():
            continue
        if run.run not in selected:
            others.append(run.run)
            continue
        table = read_table(run.path, DAS)
        label = das_settings(run.path)
        frames.append(table.assign(setting=run.setting, seed=run.seed, das_settings=label))
        stamp = read_stamp(Path(run.path), DAS_STAMP)
        for site, ks in (stamp.get("left_out") or {}).items():
            key = f"{run.arch} at {site}"
            narrow[key] = sorted({*narrow.get(key, []), *ks})
    notes = []
    if others:
        notes.append(
            f"Not shown: the DAS of {len(others)} run(s) of other learning rates than the "
            f"report selected ({', '.join(others[:5])}{', ...' if len(others) > 5 else ''})."
        )
    for key, ks in narrow.items():
        notes.append(f"k {', '.join(map(str, ks))} left out {key} (wider than it).")
    das = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return das, notes


def _draws(part: pd.DataFrame, seed: int = 0):
    """The (document, k) correctness matrix of one cell, the ks, (REPS, documents) bootstrap
    weights (clustered by run where the cell pools several), and the ks left out because some
    of the pooled documents lack them."""
    wide = part.pivot_table(index=["run", "example"], columns="k", values="correct")
    missing = [int(k) for k in wide.columns[wide.isna().any()]]
    wide = wide.dropna(axis=1)
    sizes = wide.groupby(level="run").size().tolist()
    weights = resample_weights(sizes, REPS, np.random.default_rng(seed), len(sizes) > 1)
    return wide.to_numpy(dtype=float), wide.columns.to_numpy(), weights, missing


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
        correct, ks, weights, _ = _draws(part)
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
        correct, ks, weights, missing = _draws(part)
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
                # sizes some pooled documents lack, left out of this cell's k*
                "k_left_out": ", ".join(map(str, missing)),
            }
        )
    table = pd.DataFrame(rows)
    sizes = ["k_star", "k_star_low", "k_star_high"]
    table[sizes] = table[sizes].astype("Int64")  # NaN (no k*) as <NA>
    return table
