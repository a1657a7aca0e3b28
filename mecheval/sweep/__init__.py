"""Sweeps: grids of training runs, run locally or on Ray, resumable, one Parquet table."""

from __future__ import annotations

from mecheval.sweep.grid import Run, expand_sweep, load_sweep, run_name, select_runs
from mecheval.sweep.runner import RESULTS, run_sweep, write_results


def estimate_sweep(runs: list[Run], workers: int = 1) -> dict:
    """Grid size and an estimated wall time from a measured step time per distinct model.

    Step times are measured once per (task, architecture, width, layers, batch, device)
    and multiplied by each run's step count; the total is divided over `workers`.
    """
    from mecheval.train.loop import measure_step_time

    measured: dict[tuple, float] = {}
    total_s = 0.0
    rows = []
    for run in runs:
        c = run.config
        key = (
            c.task.name,
            repr(sorted(c.task.options.items())),
            c.model.arch,
            c.model.d_model,
            c.model.n_layers,
            repr(sorted(c.model.options.items())),
            c.batch_size,
            c.device,
            c.backend,
            c.compile,
        )
        if key not in measured:
            measured[key] = measure_step_time(c.replace(progress=False))
        seconds = measured[key] * c.total_steps
        total_s += seconds
        rows.append(
            {
                "run": run.name,
                "steps": c.total_steps,
                "step_s": measured[key],
                "estimate_s": seconds,
            }
        )
    return {
        "runs": len(runs),
        "workers": workers,
        "total_run_s": total_s,
        "estimated_wall_s": total_s / workers,
        "per_run": rows,
    }


__all__ = [
    "RESULTS",
    "Run",
    "estimate_sweep",
    "expand_sweep",
    "load_sweep",
    "run_name",
    "run_sweep",
    "select_runs",
    "write_results",
]
