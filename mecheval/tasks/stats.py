"""Summary statistics of task documents, to compare settings as the study does.

`task_stats` measures one task; `stats_table` renders several side by side (the function
behind `mecheval data stats`). For a task drawn from a random grammar (ATR, whose `seed` option
is the grammar seed), one grammar is a single draw of a widely varying quantity: mean sentence
length differs several-fold between grammars. `across_grammar_seeds` therefore measures the
per-grammar means over several grammar seeds, and `stats_table(..., grammar_seeds=k)` adds
their mean and spread.

The study logs the same quantities per document (tinylang's PCFG `return_stats`):
`doc_length` is `sentence_length` here and `query_orig_target_orig_dist` is `key_to_value`
(in ATR the distance from the queried child to its parent).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from mecheval.tasks.base import Split, Task
from mecheval.tasks.batch import Batch

QUANTITIES: dict[str, str] = {
    "length": "document length in tokens (BOS ... EOS q a EOS)",
    "sentence_length": "tokens between BOS and the divider (ATR: the sentence; AR: 2 * pairs)",
    "key_to_value": "value position minus key position (ATR: queried child-parent distance)",
    "query_to_key": "query position minus key position",
}
NEEDS: dict[str, tuple[str, ...]] = {
    "length": (),
    "sentence_length": ("divider",),
    "key_to_value": ("key", "value"),
    "query_to_key": ("key", "query"),
}
"""The roles each quantity is measured from; a task without them shows none ("n/a")."""
SUMMARY_FIELDS: tuple[str, ...] = ("mean", "std", "min", "q10", "median", "q90", "max")
SEED_FIELDS: tuple[str, ...] = ("mean", "std", "min", "max")
"""Fields of `across_grammar_seeds`: over the per-grammar means (std unbiased)."""
SEED_QUANTITIES: tuple[str, ...] = ("sentence_length", "key_to_value")
"""The quantities `stats_table` shows across grammar seeds."""


def _quantity(batch: Batch, name: str) -> torch.Tensor:
    positions = batch.positions
    if not set(NEEDS[name]) <= set(positions):
        return torch.full((len(batch),), float("nan"))
    if name == "length":
        return batch.lengths
    if name == "sentence_length":
        return positions["divider"] - 1
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


def has_grammar_seed(task: Task) -> bool:
    """Whether the task draws its documents from a grammar chosen by its `seed` option."""
    return "seed" in task.data_config()


def across_grammar_seeds(
    task: Task,
    grammar_seeds: Sequence[int],
    n: int = 300,
    seed: int = 0,
    split: Split = "train",
) -> dict[str, dict[str, float | list[float]]]:
    """Per-grammar means of every quantity, and their spread, over several grammar seeds.

    Args:
        task: a task with a grammar seed (`has_grammar_seed`); its other options are kept.
        grammar_seeds: the grammar seeds (at least one).
        n, seed, split: documents sampled from each grammar, as in `task_stats`.

    Returns:
        `{quantity: {"per_seed": [mean of each grammar], "mean", "std", "min", "max"}}`, the
        last four over the per-grammar means (std unbiased, 0 for one seed).
    """
    if not has_grammar_seed(task):
        raise ValueError(f"{task.label()} has no grammar seed option")
    if not grammar_seeds:
        raise ValueError("across_grammar_seeds needs at least one grammar seed")
    per_seed: dict[str, list[float]] = {name: [] for name in QUANTITIES}
    for grammar_seed in grammar_seeds:
        batch = dataclasses.replace(task, seed=grammar_seed).sample(n, seed, split)
        for name in QUANTITIES:
            per_seed[name].append(float(_quantity(batch, name).double().mean()))
    out: dict[str, dict[str, float | list[float]]] = {}
    for name, means in per_seed.items():
        values = np.asarray(means)
        out[name] = {
            "per_seed": means,
            "mean": float(values.mean()),
            "std": float(values.std(ddof=1)) if len(values) > 1 else 0.0,
            "min": float(values.min()),
            "max": float(values.max()),
        }
    return out


def _render(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return lines


def stats_table(
    tasks: Sequence[Task],
    n: int = 4096,
    seed: int = 0,
    split: Split = "train",
    grammar_seeds: int = 0,
) -> str:
    """A text table of `task_stats` for several tasks, one row per task.

    Each cell reads `mean ± std [q10, median, q90] max`. With `grammar_seeds = k > 0`, tasks
    with a grammar seed get a second table: for `sentence_length` and `key_to_value`, the mean
    over the grammar seeds `s .. s+k-1` (s = the task's seed) of the per-grammar means of `n`
    documents, their standard deviation across grammars, and the lowest and highest grammar.
    """
    header = ["task", *QUANTITIES]
    rows = [header]
    for task in tasks:
        stats = task_stats(task, n=n, seed=seed, split=split)
        cells = [
            "n/a"
            if np.isnan(s["mean"])
            else f"{s['mean']:.1f} ± {s['std']:.1f} [{s['q10']:g}, {s['median']:g}, "
            f"{s['q90']:g}] {s['max']:g}"
            for s in (stats[name] for name in QUANTITIES)
        ]
        rows.append([task.label(), *cells])
    lines = _render(rows)
    lines.append(
        f"{n} {split} documents per task, seed {seed}; cells: mean ± std [q10, median, q90] max"
    )
    seeded = [task for task in tasks if has_grammar_seed(task)] if grammar_seeds > 0 else []
    if seeded:
        seed_rows = [["task", "grammar seeds", *SEED_QUANTITIES]]
        for task in seeded:
            first = task.data_config()["seed"]
            spread = across_grammar_seeds(
                task, range(first, first + grammar_seeds), n=n, seed=seed, split=split
            )
            cells = [
                f"{s['mean']:.2f} ± {s['std']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"
                for s in (spread[name] for name in SEED_QUANTITIES)
            ]
            seeds = f"{first}..{first + grammar_seeds - 1}"
            seed_rows.append([dataclasses.replace(task, seed=0).label(), seeds, *cells])
        lines += ["", *_render(seed_rows)]
        lines.append(
            f"per grammar seed: mean of {n} {split} documents; cells: mean over grammars ± std "
            "across grammars [lowest, highest grammar]"
        )
    return "\n".join(lines)
