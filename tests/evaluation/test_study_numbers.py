"""The study's accuracies beside ours: a run of the study's own setting gets the study's figure
value; any other setting (other task options, depth, width or architecture) gets none."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from mecheval.evaluation.results import with_study_accuracy
from mecheval.evaluation.study_numbers import study_accuracy

pytestmark = pytest.mark.pipeline


@pytest.mark.parametrize(
    ("task", "options", "arch", "d_model", "expected"),
    [
        ("ar", {}, "mamba", 64, (0.81, "ar_32.pdf")),
        ("ar", {"num_keys": 4096, "corruption_range": "own"}, "based", 32, (0.93, "ar_32.pdf")),
        ("ar", {}, "attention", 256, (1.00, "ar_32.pdf")),
        ("atr", {"max_rhs_len": 5, "num_terminals": 20}, "mamba", 16, (0.91, "atr.pdf (5, 20)")),
        (
            "atr",
            {"max_rhs_len": 5, "num_terminals": 8192, "terminal_factor": 20},
            "hyena",
            128,
            (0.69, "atr.pdf (5, 8192)"),
        ),
        ("ar", {"num_pairs": 4, "num_keys": 16}, "mamba", 64, None),  # not the study's task
        ("ar", {}, "mamba_noconv", 64, None),  # not in the figure
        ("ar", {}, "mamba", 48, None),  # not one of the study's widths
        ("atr", {"max_rhs_len": 5, "num_terminals": 20, "holdout": 0.2}, "mamba", 64, None),
    ],
)
def test_study_accuracy_only_for_the_studys_settings(task, options, arch, d_model, expected):
    assert study_accuracy(task, options, arch, d_model, 2) == expected


def test_other_depths_have_no_study_number_and_the_report_column_fills_in():
    assert study_accuracy("ar", {}, "mamba", 64, 1) is None
    frame = pd.DataFrame(
        [
            {"task": "ar", "arch": a, "d_model": 64, "n_layers": 2, "task_label": json.dumps(t)}
            for a, t in (("mamba", {"name": "ar"}), ("based", {"name": "ar", "options": {}}))
        ]
    )
    shown = with_study_accuracy(frame)
    assert list(shown["study"]) == [0.81, 0.99]
    assert list(shown["study_figure"]) == ["ar_32.pdf", "ar_32.pdf"]


def test_the_study_s_own_grammar_instances_have_its_figures():
    easy = {"max_rhs_len": 5, "num_terminals": 20, "seed": 42, "draw": "study"}
    medium = {"max_rhs_len": 10, "num_terminals": 20, "seed": 42, "draw": "study_after_easy"}
    assert study_accuracy("atr", easy, "mamba", 16, 2) == (0.91, "atr.pdf (5, 20)")
    assert study_accuracy("atr", medium, "mamba", 16, 2) == (0.77, "atr.pdf (10, 20)")
