"""`estimate_sweep`: a sweep's size and its estimated wall time, from measured step times."""

from __future__ import annotations

from mecheval.sweep.grid import Run


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
