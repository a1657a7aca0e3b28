"""Tables the report draws from evaluated runs.

    seed_runs(best, results)        every evaluated seed of the selected runs' configurations
    evidence_table(best, results)   read-outs of each selected run, with bootstrap intervals over
                                    its documents and, where the configuration ran with several
                                    seeds, over seeds too; plus each layer's short-conv read-outs
    over_training_table(best)       the read-outs of every kept checkpoint
                                    (mecheval.evaluation.over_training)
    formation_steps(table)          per run: the first step each mechanism reaches 0.5
    distance_table(best)            accuracy and read-outs by key-to-query distance

`best` and `results` are the report's tables (mecheval.evaluation.results.collect_results /
best_runs): one row per run with its path, identity (task, arch, d_model, n_layers, lr, seed)
and accuracies.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from mecheval.evaluation.over_training import (
    CONV_POSITIONS,
    conv_column,
    is_conv_cell,
    parse_conv_column,
)
from mecheval.interventions import attrib_intervals, readout
from mecheval.interventions.scores import MECHANISMS
from mecheval.run_folder.files import (
    EXAMPLES,
    INTERVENTIONS,
    OVER_TRAINING,
    evaluated_conv_sites,
    read_table,
)

READOUTS = tuple(MECHANISMS)
IDENTITY = (
    "run",
    "arch",
    "d_model",
    "n_layers",
    "lr",
    "task",
    "step",
    "accuracy",
    "corruption",
    "replacement_ids",
)
BOOTSTRAP_REPS = 1000


def key_grid(path: str | Path) -> pd.DataFrame:
    """The key-corruption grid of a run, grid columns only."""
    grid = read_table(path, INTERVENTIONS)
    grid = grid[grid["corruption"] == "key"]
    return grid.drop(columns=[c for c in IDENTITY if c in grid])


def same_configuration(run: pd.Series, results: pd.DataFrame) -> pd.DataFrame:
    """Runs of the same configuration as `run` (task instance, run length, model, learning
    rate), whatever their seed, `run` included."""
    same = pd.Series(True, index=results.index)
    for column in ("task_label", "steps", "arch", "d_model", "n_layers", "lr"):
        same &= results[column] == run[column]
    return results[same]


def seed_siblings(run: pd.Series, results: pd.DataFrame) -> pd.DataFrame:
    """The evaluated runs of `run`'s configuration (same_configuration), `run` included."""
    runs = same_configuration(run, results)
    return runs[runs["evaluated"]]


def seed_runs(best: pd.DataFrame, results: pd.DataFrame) -> pd.DataFrame:
    """Every evaluated seed of each selected run's configuration (seed_siblings), once each."""
    if best.empty:
        return best
    runs = pd.concat([seed_siblings(run, results) for _, run in best.iterrows()])
    return runs.drop_duplicates(subset="run").reset_index(drop=True)


def evidence_table(best: pd.DataFrame, results: pd.DataFrame) -> pd.DataFrame:
    """One row per given run: identity, dev_accuracy, the read-outs with `_low`/`_high`
    (documents resampled), `_seeds_low`/`_seeds_high` and `seeds` when its configuration has
    several evaluated seeds (runs and documents resampled; once per configuration), mechanism,
    and for models with short convs their read-outs (with bounds; conv_readouts)."""
    rows, pooled_by_seeds = [], {}
    for _, run in best.iterrows():
        row = {
            k: run[k]
            for k in ("run", "task", "setting", "arch", "d_model", "n_layers", "lr", "dev_accuracy")
        }
        if "seed" in run:
            row["seed"] = run["seed"]
        if "study_scale" in run:
            row["study_scale"] = bool(run["study_scale"])
        if not run["evaluated"]:
            rows.append(row)
            continue
        grid = key_grid(run["path"])
        scores = readout(grid, intervals=True, reps=BOOTSTRAP_REPS).iloc[0].to_dict()
        row.update(scores)
        seeds = seed_siblings(run, results)
        row["seeds"] = len(seeds)
        if len(seeds) > 1:
            key = tuple(seeds["run"])
            if key not in pooled_by_seeds:
                grids = [key_grid(r.path).assign(run=r.run) for r in seeds.itertuples()]
                pooled = pd.concat(grids, ignore_index=True)
                pooled_by_seeds[key] = readout(
                    pooled, intervals=True, cluster="run", reps=BOOTSTRAP_REPS
                ).iloc[0]
            many = pooled_by_seeds[key]
            for name in READOUTS:
                if name in many:
                    row[f"{name}_seeds_low"] = many.get(f"{name}_low")
                    row[f"{name}_seeds_high"] = many.get(f"{name}_high")
        row.update(conv_readouts(grid, evaluated_conv_sites(run["path"])))
        rows.append(row)
    return pd.DataFrame(rows)


def conv_readouts(grid: pd.DataFrame, declared: dict | None = None) -> dict[str, float]:
    """Attrib (with bounds) of each short conv's output at the value and the two positions
    after it, named by `conv_column` (`conv_value+1`, `conv_l1_value`, `k_conv_value`, ...);
    the convs are the sites `declared` per layer (the mixers' `conv_sites` the evaluation
    recorded; None: not recorded, the zoo's conv sites by name)."""
    row = {}
    conv = grid[is_conv_cell(grid, declared)]
    for (site, layer), cells in conv.groupby(["site", "layer"]):
        cells = attrib_intervals(cells, reps=BOOTSTRAP_REPS).set_index("position")
        for position in CONV_POSITIONS:
            if position in cells.index:
                name = conv_column(layer, position, site)
                row[name] = cells.loc[position, "attrib"]
                row[f"{name}_low"] = cells.loc[position, "attrib_low"]
                row[f"{name}_high"] = cells.loc[position, "attrib_high"]
    return row


def over_training_table(best: pd.DataFrame) -> pd.DataFrame:
    """The stored read-outs over training of the selected runs, with their identity."""
    frames = []
    for _, run in best.iterrows():
        if (Path(run["path"]) / OVER_TRAINING).exists():
            table = read_table(run["path"], OVER_TRAINING)
            for column in ("task", "setting", "arch", "d_model", "n_layers", "lr"):
                table.insert(0, column, run[column])
            frames.append(table)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def formation_steps(table: pd.DataFrame, threshold: float = 0.5) -> pd.DataFrame:
    """Per run: the first kept step at which each read-out reaches `threshold` (NaN: never),
    which came first: induction or direct retrieval, and the first step at which a short
    conv's read-out does (`conv_from`; `conv_at` names that read-out, the highest there)."""
    if table.empty:
        return table
    rows = []
    for run, part in table.sort_values("step").groupby("run", sort=False):
        row = {k: part[k].iloc[0] for k in ("setting", "arch", "d_model")}
        for name in READOUTS:
            reached = part[part[name] >= threshold] if name in part else part.iloc[:0]
            row[f"{name}_from"] = float(reached["step"].iloc[0]) if len(reached) else np.nan
        direct = np.nanmin([row["direct_early_from"], row["direct_late_from"], np.inf])
        induction = row["induction_from"]
        if np.isnan(induction) and np.isinf(direct):
            row["first"] = "neither"
        elif np.isnan(induction) or direct < induction:
            row["first"] = "direct retrieval"
        elif np.isinf(direct) or induction < direct:
            row["first"] = "induction"
        else:
            row["first"] = "same step"
        row.update(_conv_formation(part, threshold))
        row["run"] = run
        rows.append(row)
    frame = pd.DataFrame(rows)
    for name in (*READOUTS, "conv"):
        frame[f"{name}_from"] = frame[f"{name}_from"].astype("Int64")
    return frame


def _conv_formation(part: pd.DataFrame, threshold: float) -> dict:
    """The first step of `part` (one run's checkpoints, in step order) at which a short-conv
    read-out reaches `threshold`, and which one (the highest at that step)."""
    names = [c for c in part if parse_conv_column(c) and part[c].notna().any()]
    reached = part[(part[names] >= threshold).any(axis=1)] if names else part.iloc[:0]
    if reached.empty:
        return {"conv_from": np.nan, "conv_at": None}
    first = reached.iloc[0]
    return {"conv_from": float(first["step"]), "conv_at": first[names].astype(float).idxmax()}


def distance_table(best: pd.DataFrame, bins: int = 4) -> pd.DataFrame:
    """Per selected run and key-to-query distance bin (quantile bins of its documents): n,
    accuracy and the read-outs (key corrupted)."""
    rows = []
    for _, run in best[best["evaluated"]].iterrows():
        path = Path(run["path"])
        if not (path / EXAMPLES).exists():
            continue
        examples = read_table(path, EXAMPLES)
        distance = examples["distance"]
        edges = np.unique(np.quantile(distance, np.linspace(0, 1, bins + 1)))
        if len(edges) < 2:
            edges = np.array([distance.min(), distance.max()])
        examples["bin"] = pd.cut(distance, edges, include_lowest=True, duplicates="drop")
        grid = key_grid(path).merge(examples[["example", "bin"]], on="example")
        for interval, docs in examples.groupby("bin", observed=True):
            row = {k: run[k] for k in ("setting", "arch", "d_model")}
            inside = docs["distance"]  # integer distances: name the bin by its range
            row["distance"] = f"{inside.min()}-{inside.max()}"
            row["n"] = len(docs)
            row["accuracy"] = float(docs["correct"].mean())
            part = grid[grid["bin"] == interval].drop(columns=["bin"])
            if not part.empty:
                scores = readout(part).iloc[0]
                row.update({name: scores.get(name, np.nan) for name in READOUTS})
            rows.append(row)
    return pd.DataFrame(rows)
