"""The finished runs as a table, and the runs a report selects from it: the best learning rate
per (task setting, architecture, width, depth), with the study's accuracy and the spread over
seeds beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from mecheval.evaluation.analysis import same_configuration
from mecheval.evaluation.study_numbers import at_study_scale, study_accuracy
from mecheval.run_folder.files import INTERVENTIONS, read_result
from mecheval.run_folder.status import FINISHED
from mecheval.tasks import make_task

# What identifies a model in the report's tables (the best learning rate is chosen per one).
MODEL = ["task", "setting", "arch", "d_model", "n_layers"]


def task_setting(task_section: dict, steps: int) -> str:
    """A run's setting, readable: the task name, its non-default options and the run's length,
    e.g. "ar(), 50,016 steps" (the study's AR as the study trains it) or "ar(num_pairs=4,
    num_keys=16), 3,000 steps". Runs of one setting are compared (the best learning rate, the
    findings); runs of another length are another setting."""
    task = make_task(task_section["name"], **task_section.get("options", {}))
    return f"{task.label()}, {steps:,} steps"


def collect_results(folders: pd.DataFrame) -> pd.DataFrame:
    """One row per finished run of `folders` (mecheval.run_folder.status.status_table): its identity
    and accuracies."""
    rows = []
    for run in map(Path, folders.loc[folders["status"] == FINISHED, "path"]):
        result = read_result(run)
        config = result["config"]
        rows.append(
            {
                "run": run.name,
                "path": str(run),
                "task": config["task"]["name"],
                "setting": task_setting(config["task"], result["steps"]),
                "task_label": json.dumps(config["task"], sort_keys=True),
                "arch": config["model"]["arch"],
                "d_model": config["model"]["d_model"],
                "n_layers": config["model"]["n_layers"],
                "lr": config["optim"]["lr"],
                "seed": config["seed"],
                "dev_accuracy": result["dev_accuracy"],
                "test_accuracy": result["test_accuracy"],
                "steps": result["steps"],
                "study_scale": at_study_scale(
                    config["task"]["name"], config["task"].get("options", {}), result["steps"]
                ),
                "wall_time_s": result["wall_time_s"],
                "evaluated": (run / INTERVENTIONS).exists(),
            }
        )
    return pd.DataFrame(rows)


def best_runs(results: pd.DataFrame) -> pd.DataFrame:
    """The run with the best dev accuracy per (task setting, arch, width, depth); ties: smaller
    lr."""
    ordered = results.sort_values(["dev_accuracy", "lr"], ascending=[False, True])
    return ordered.groupby(MODEL, sort=False).head(1).sort_values(MODEL).reset_index(drop=True)


def with_study_accuracy(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` (one row per run, with task_label) plus the study's accuracy for the same
    setting and the figure it is read from, where the study reports one."""
    values, figures = [], []
    for row in frame.itertuples():
        options = json.loads(row.task_label).get("options", {})
        hit = study_accuracy(row.task, options, row.arch, row.d_model, row.n_layers)
        values.append(hit[0] if hit else float("nan"))
        figures.append(hit[1] if hit else "")
    return frame.assign(study=values, study_figure=figures)


def with_seed_spread(frame: pd.DataFrame, results: pd.DataFrame) -> pd.DataFrame:
    """`frame` (selected runs) plus, over every finished seed of each one's configuration
    (mecheval.evaluation.analysis.same_configuration): `seeds`, and the dev accuracy's mean,
    lowest and highest."""
    spreads = []
    for _, run in frame.iterrows():
        dev = same_configuration(run, results)["dev_accuracy"]
        spreads.append(
            {"seeds": len(dev), "dev_mean": dev.mean(), "dev_min": dev.min(), "dev_max": dev.max()}
        )
    return pd.concat([frame, pd.DataFrame(spreads, index=frame.index)], axis=1)
