"""Sweeps: grids of training runs, run locally or on Ray (the executor), resumable, one Parquet
table."""

from __future__ import annotations

from mecheval.sweep.estimate import estimate_sweep
from mecheval.sweep.executor import EXECUTION, EXECUTORS, Executor, execution_of
from mecheval.sweep.grid import Run, expand_sweep, load_sweep, run_name, select_runs
from mecheval.sweep.runner import RESULTS, run_sweep, write_results

__all__ = [
    "EXECUTION",
    "EXECUTORS",
    "RESULTS",
    "Executor",
    "Run",
    "estimate_sweep",
    "execution_of",
    "expand_sweep",
    "load_sweep",
    "run_name",
    "run_sweep",
    "select_runs",
    "write_results",
]
