"""Every run folder under a path, and what became of its run, for the report to account for.

    run_folders(path)     the run folders: `path` itself when it is one, else its subfolders
                          that are (a folder holding config.yaml, result.json, error.json or
                          checkpoints/)
    finished_runs(path)   those that hold a result.json
    folder_status(run)    one row: run, path, status, step, evaluated, detail
    status_table(path)    those rows for every run folder under `path`

Statuses:
- finished: result.json is readable (step: the run's steps; detail: its dev accuracy);
- diverged: the run stopped on a non-finite loss or weights (error.json of a sweep; step: the
  first non-finite step; detail: the reason);
- failed: the run stopped on another error (error.json; detail: the error);
- incomplete: neither result nor error: training is running, or was stopped (step: the newest
  checkpoint's);
- unreadable: result.json or error.json cannot be read (detail: which, and why).
`evaluated` is the checkpoint step the stored evaluation used (None when there is none).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd

from mecheval.io import DamagedFileError
from mecheval.run_folder.checkpoints import list_checkpoints
from mecheval.run_folder.files import (
    CHECKPOINTS,
    CONFIG,
    ERROR,
    INTERVENTIONS,
    RESULT,
    evaluated_step,
    read_error,
    read_result,
)

FINISHED, DIVERGED, FAILED = "finished", "diverged", "failed"
INCOMPLETE, UNREADABLE = "incomplete", "unreadable"
STATUSES = (FINISHED, DIVERGED, FAILED, INCOMPLETE, UNREADABLE)
MARKERS = (CONFIG, RESULT, ERROR, CHECKPOINTS)
COLUMNS = ("run", "path", "status", "step", "evaluated", "detail")
# Where mecheval.train.loop's TrainingDiverged messages name the first non-finite step: "(6..8" for
# a run of non-finite losses, "after step 4" for non-finite weights.
_DIVERGED_AT = re.compile(r"\((\d+)\.\.\d+|after step (\d+)")


def is_run_folder(path: Path) -> bool:
    return path.is_dir() and any((path / marker).exists() for marker in MARKERS)


def run_folders(path: str | Path) -> list[Path]:
    """`path` itself when it is a run folder, else its subfolders that are, sorted."""
    path = Path(path)
    if is_run_folder(path):
        return [path]
    if not path.is_dir():
        return []
    return sorted(p for p in path.iterdir() if is_run_folder(p))


def finished_runs(path: str | Path) -> list[Path]:
    """`path` itself if it is a finished run, else its finished runs (one level down)."""
    path = Path(path)
    if (path / RESULT).exists():
        return [path]
    return sorted(p.parent for p in path.glob(f"*/{RESULT}"))


def _newest_step(run: Path) -> int | None:
    kept = list_checkpoints(run / CHECKPOINTS)
    return kept[-1][0] if kept else None


def folder_status(run: Path) -> dict[str, Any]:
    """The row of one run folder (see the module docstring)."""
    row: dict[str, Any] = {"run": run.name, "path": str(run), "evaluated": None}
    if (run / RESULT).exists():
        try:
            result = read_result(run)
        except DamagedFileError as error:
            return {**row, "status": UNREADABLE, "step": None, "detail": str(error)}
        if (run / INTERVENTIONS).exists():
            row["evaluated"] = evaluated_step(run)
        detail = f"dev accuracy {result['dev_accuracy']:.3f}"
        return {**row, "status": FINISHED, "step": result["steps"], "detail": detail}
    if (run / ERROR).exists():
        try:
            error = read_error(run)
        except DamagedFileError as unreadable:
            return {**row, "status": UNREADABLE, "step": None, "detail": str(unreadable)}
        name, _, message = str(error).partition(": ")
        if name == "TrainingDiverged":
            found = _DIVERGED_AT.search(message)
            step = int(next(g for g in found.groups() if g)) if found else _newest_step(run)
            return {**row, "status": DIVERGED, "step": step, "detail": message}
        return {**row, "status": FAILED, "step": _newest_step(run), "detail": str(error)}
    step = _newest_step(run)
    newest = f"newest checkpoint: step {step}" if step is not None else "no checkpoint yet"
    detail = f"no {RESULT}: training is running or was stopped ({newest})"
    return {**row, "status": INCOMPLETE, "step": step, "detail": detail}


def status_table(path: str | Path) -> pd.DataFrame:
    """One row per run folder under `path` (columns `COLUMNS`; steps as nullable integers)."""
    rows = [folder_status(run) for run in run_folders(path)]
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    for column in ("step", "evaluated"):
        table[column] = table[column].astype("Int64")
    return table


def status_counts(table: pd.DataFrame) -> str:
    """ "5 finished, 1 diverged" (statuses in `STATUSES` order, absent ones left out)."""
    counts = table["status"].value_counts()
    return ", ".join(f"{counts[s]} {s}" for s in STATUSES if s in counts) or "none"
