"""The study's accuracies, read off the figures in its repository (notebooks/figs/*.pdf; about
+-0.02 to 0.05), for the report's "study" column: the dev accuracy of the best learning rate
per architecture and width, 2 layers; and whether a run is at the study's scale.

    study_accuracy(task, task_options, arch, d_model, n_layers) -> (value, figure) or None
    at_study_scale(task, task_options, steps) -> bool
"""

from __future__ import annotations

from collections.abc import Mapping

from mecheval.tasks import make_task

WIDTHS = (16, 32, 64, 128, 256)

# figure -> {arch: accuracies at d_model 16, 32, 64, 128, 256}
_AR = {
    "attention": (0.05, 1.00, 1.00, 1.00, 1.00),
    "based": (0.24, 0.93, 0.99, 0.99, 0.99),
    "mamba": (0.10, 0.77, 0.81, 0.90, 0.91),
    "hyena": (0.02, 0.01, 0.03, 0.14, 0.30),
    "base_conv": (0.02, 0.01, 0.03, 0.06, 0.10),
    "h3": (0.01, 0.01, 0.02, 0.02, 0.02),
}
_ATR = {
    (5, 20): {
        "attention": (0.68, 0.91, 0.94, 0.95, 0.96),
        "based": (0.82, 0.91, 0.93, 0.93, 0.92),
        "mamba": (0.91, 0.94, 0.96, 0.97, 0.96),
        "h3": (0.82, 0.88, 0.90, 0.94, 0.95),
        "hyena": (0.76, 0.81, 0.85, 0.93, 0.93),
        "base_conv": (0.67, 0.75, 0.82, 0.87, 0.90),
    },
    (5, 8192): {
        "attention": (0.72, 0.84, 0.89, 0.87, 0.87),
        "based": (0.68, 0.83, 0.87, 0.87, 0.87),
        "mamba": (0.70, 0.78, 0.87, 0.87, 0.88),
        "h3": (0.49, 0.63, 0.72, 0.76, 0.76),
        "hyena": (0.46, 0.58, 0.65, 0.69, 0.70),
        "base_conv": (0.42, 0.47, 0.56, 0.60, 0.66),
    },
    (10, 20): {
        "attention": (0.51, 0.57, 0.75, 0.80, 0.81),
        "based": (0.63, 0.72, 0.70, 0.71, 0.73),
        "mamba": (0.77, 0.88, 0.86, 0.90, 0.92),
        "hyena": (0.58, 0.64, 0.63, 0.66, 0.69),
        "base_conv": (0.56, 0.63, 0.65, 0.70, 0.69),
    },
}
# The study's task settings, as mecheval task options.
_SETTINGS = {
    "ar_32.pdf": ("ar", {}, _AR),
    **{
        f"atr.pdf {setting}": (
            "atr",
            {"max_rhs_len": setting[0], "num_terminals": setting[1]},
            table,
        )
        for setting, table in _ATR.items()
    },
}


# The study's training lengths: 16 epochs of AR, 32 of ATR, over 100,032 documents in
# batches of 32 (docs/study.md, "Training").
STUDY_STEPS = {"ar": 50_016, "atr": 100_032}


def _figures_of(task: str, task_options: Mapping[str, object]) -> list[tuple[str, dict]]:
    """The study's figures whose task setting makes this task's documents, as (figure,
    {arch: accuracies by width}); options that only change how documents are corrupted do not
    matter."""
    documents = make_task(task, **task_options).data_config()
    return [
        (figure, table)
        for figure, (name, options, table) in _SETTINGS.items()
        if name == task and make_task(name, **options).data_config() == documents
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
