"""Summary statistics of task documents, to compare settings as the study does.

`task_stats` measures one task; `stats_table` renders several side by side (the function
behind `mecheval data stats`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mecheval.tasks.base import Split, Task
from mecheval.tasks.batch import Batch

QUANTITIES: dict[str, str] = {
    "length": "document length in tokens (BOS ... EOS q a EOS)",
    "key_to_value": "value position minus key position",
    "query_to_key": "query position minus key position",
}
SUMMARY_FIELDS: tuple[str, ...] = ("mean", "std", "min", "q10", "median", "q90", "max")


def _quantity(batch: Batch, name: str) -> torch.Tensor:
    positions = batch.positions
    if name == "length":
        return batch.lengths
    if name == "key_to_value":
        return positions["value"] - positions["key"]
    return positions["query"] - positions["key"]


def summarize(values: torch.Tensor) -> dict[str, float]:
    """Mean, standard deviation (unbiased; 0 for one value), min, 10/50/90% quantiles, max.

    Args:
        values: 1-D tensor of at least one number.
    """
    values = values.double()
    quantiles = torch.quantile(values, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64))
    return {
        "mean": float(values.mean()),
        "std": float(values.std()) if len(values) > 1 else 0.0,
        "min": float(values.min()),
        "q10": float(quantiles[0]),
        "median": float(quantiles[1]),
        "q90": float(quantiles[2]),
        "max": float(values.max()),
    }


def task_stats(
    task: Task, n: int = 4096, seed: int = 0, split: Split = "train"
) -> dict[str, dict[str, float]]:
    """Statistics of `n` sampled documents of `task`.

    Returns:
        `{quantity: {field: value}}` for each quantity in `QUANTITIES` and each field in
        `SUMMARY_FIELDS`.
    """
    batch = task.sample(n, seed, split)
    return {name: summarize(_quantity(batch, name)) for name in QUANTITIES}


def stats_table(tasks: Sequence[Task], n: int = 4096, seed: int = 0, split: Split = "train") -> str:
    """A text table of `task_stats` for several tasks, one row per task.

    Each cell reads `mean ± std [q10, median, q90] max`.
    """
    header = ["task", *QUANTITIES]
    rows = [header]
    for task in tasks:
        stats = task_stats(task, n=n, seed=seed, split=split)
        cells = [
            f"{s['mean']:.1f} ± {s['std']:.1f} [{s['q10']:g}, {s['median']:g}, {s['q90']:g}] "
            f"{s['max']:g}"
            for s in (stats[name] for name in QUANTITIES)
        ]
        rows.append([task.label(), *cells])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    note = f"{n} {split} documents per task, seed {seed}; cells: mean ± std [q10, median, q90] max"
    return "\n".join([*(line.rstrip() for line in lines), note])
