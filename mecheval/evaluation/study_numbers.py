"""The study's accuracies, read off the figures in its repository (notebooks/figs/*.pdf; about
+-0.02 to 0.05; the table is study_accuracies.csv beside this module), for the report's "study"
column: the dev accuracy of the best learning rate per architecture and width, 2 layers; and
whether a run is at the study's scale.

    study_accuracy(task, task_options, arch, d_model, n_layers) -> (value, figure) or None
    at_study_scale(task, task_options, steps) -> bool
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from mecheval.evaluation.shipped import shipped_rows
from mecheval.tasks import make_task

WIDTHS = (16, 32, 64, 128, 256)

# Task options that pick an instance of a setting (docs/deviations.md, "ATR grammar instances").
INSTANCE_KEYS = ("seed", "draw")
# The study's task settings (its figures), as mecheval task options.
_SETTINGS = {
    "ar_32.pdf": ("ar", {}),
    **{
        f"atr.pdf ({rhs}, {terminals})": ("atr", {"max_rhs_len": rhs, "num_terminals": terminals})
        for rhs, terminals in ((5, 20), (5, 8192), (10, 20))
    },
}


@functools.cache
def _accuracies() -> dict[str, dict[str, tuple[float, ...]]]:
    """figure -> {arch: accuracies at WIDTHS}, from study_accuracies.csv beside this module."""
    table: dict[str, dict[str, tuple[float, ...]]] = {}
    for row in shipped_rows("study_accuracies.csv"):
        accuracies = tuple(float(row[f"d{width}"]) for width in WIDTHS)
        table.setdefault(row["figure"], {})[row["arch"]] = accuracies
    return table


# The study's training lengths: 16 epochs of AR, 32 of ATR, over 100,032 documents in
# batches of 32 (docs/study.md, "Training").
STUDY_STEPS = {"ar": 50_016, "atr": 100_032}


def _setting(task: str, task_options: Mapping[str, object]) -> dict:
    """What makes a task's documents, less the draw of its instance (the grammar's seed and
    generator: the study's figures are of its settings, each run on one instance)."""
    documents = make_task(task, **task_options).data_config()
    return {key: value for key, value in documents.items() if key not in INSTANCE_KEYS}


def _figures_of(task: str, task_options: Mapping[str, object]) -> list[tuple[str, dict]]:
    """The study's figures whose task setting makes this task's documents, as (figure,
    {arch: accuracies by width}); options that only change how documents are corrupted, or
    which instance of the setting is drawn, do not matter."""
    setting = _setting(task, task_options)
    return [
        (figure, _accuracies()[figure])
        for figure, (name, options) in _SETTINGS.items()
        if name == task and _setting(name, options) == setting
    ]


def at_study_scale(task: str, task_options: Mapping[str, object], steps: int) -> bool:
    """Whether a run had the study's task setting (documents as its figures' tasks) and at
    least its number of training steps: a finding that fails to show in a smaller run has not
    been contradicted."""
    return steps >= STUDY_STEPS.get(task, 0) and bool(_figures_of(task, task_options))


def study_accuracy(
    task: str, task_options: Mapping[str, object], arch: str, d_model: int, n_layers: int
) -> tuple[float, str] | None:
    """The study's accuracy for this setting and the figure it comes from, or None when the
    study reports none (other tasks or options, depths, widths or architectures)."""
    if n_layers != 2 or d_model not in WIDTHS:
        return None
    for figure, table in _figures_of(task, task_options):
        if arch in table:
            return table[arch][WIDTHS.index(d_model)], figure
    return None
