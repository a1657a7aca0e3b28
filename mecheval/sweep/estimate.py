"""`estimate_sweep`: a sweep's size and its estimated wall time, from measured step times."""

from __future__ import annotations

from tqdm.auto import tqdm

from mecheval.sweep.grid import Run
from mecheval.train.config import TrainConfig


def _model_key(c: TrainConfig) -> tuple:
    """What a step's time depends on: runs that share it share one measurement."""
    return (
        c.task.name,
        repr(sorted(c.task.options.items())),
        c.model.arch,
        c.model.d_model,
        c.model.n_layers,
        repr(sorted(c.model.options.items())),
        c.batch_size,
        c.device,
        c.backend,
        c.precision,
        c.compile,
    )


def estimate_sweep(runs: list[Run], workers: int = 1, progress: bool = False) -> dict:
    """Grid size and an estimated wall time from a measured step time per distinct model.

    Step times are measured once per (task, architecture, width, layers, batch, device,
    backend, precision) and multiplied by each run's step count; the total is divided over
    `workers`. `progress` shows a bar over the measurements.
    """
    from mecheval.train.loop import measure_step_time

    distinct: dict[tuple, TrainConfig] = {}
    for run in runs:
        distinct.setdefault(_model_key(run.config), run.config)
    measured = {
        key: measure_step_time(config.replace(progress=False))
        for key, config in tqdm(
            distinct.items(), desc="measuring step times", unit="model", disable=not progress
        )
    }
    rows = []
    for run in runs:
        c = run.config
        step_s = measured[_model_key(c)]
        rows.append(
            {
                "run": run.name,
                "steps": c.total_steps,
                "step_s": step_s,
                "estimate_s": step_s * c.total_steps,
            }
        )
    total_s = sum(row["estimate_s"] for row in rows)
    return {
        "runs": len(runs),
        "models_measured": len(measured),
        "workers": workers,
        "total_run_s": total_s,
        "estimated_wall_s": total_s / workers,
        "per_run": rows,
    }
