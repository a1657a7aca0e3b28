"""`estimate_sweep`: a sweep's size and its estimated wall time, from measured step times."""

from __future__ import annotations

from tqdm.auto import tqdm

from mecheval.sweep.grid import Run
from mecheval.sweep.runner import STACK_MEMORY, stacks
from mecheval.train import timing
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


def estimate_sweep(
    runs: list[Run], workers: int = 1, progress: bool = False, stack: bool = False
) -> dict:
    """Grid size and an estimated wall time from a measured step time per distinct model.

    Step times are measured once per (task, architecture, width, layers, batch, device,
    backend, precision) and stack size, and multiplied by each run's step count; the total is
    divided over `workers`. With `stack`, runs that stack (mecheval.sweep.runner.stacks) are
    timed as one stack and each run is charged its share. `progress` shows a bar over the
    measurements.
    """
    groups = stacks(runs, STACK_MEMORY) if stack else [[run] for run in runs]
    distinct: dict[tuple, list[TrainConfig]] = {}
    for group in groups:
        key = (_model_key(group[0].config), len(group))
        distinct.setdefault(key, [r.config.replace(progress=False) for r in group])

    def measure(configs: list[TrainConfig]) -> float:
        if len(configs) == 1:
            return timing.measure_step_time(configs[0])
        return timing.measure_stacked_step_time(configs)

    measured = {
        key: measure(configs)
        for key, configs in tqdm(
            distinct.items(), desc="measuring step times", unit="model", disable=not progress
        )
    }
    rows = []
    for group in groups:
        step_s = measured[(_model_key(group[0].config), len(group))] / len(group)
        for run in group:
            c = run.config
            rows.append(
                {
                    "run": run.name,
                    "steps": c.total_steps,
                    "step_s": step_s,
                    "estimate_s": step_s * c.total_steps,
                    "stack_size": len(group),
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
