"""What the conformance checks share (mecheval/testing/report.py): a report prints one line per
check under its heading, its error carries it, and the grid check compares the interchange
grid with the per-cell loop, failing by name when a column or the cells differ."""

from __future__ import annotations

import pytest
import torch

import mecheval.testing.report as report_module
from mecheval.models import build_model
from mecheval.tasks import make_task
from mecheval.testing import Check, MixerCheckError, MixerReport, TaskReport
from mecheval.testing.report import grid_against_loop


def test_reports_print_a_line_per_check_under_their_heading():
    checks = [Check("shape", True, "(2, 5, 8)"), Check("grid", False, "kl differs"),
              Check("state", None, "no state site")]  # fmt: skip
    mixer = MixerReport("mamba", checks)
    assert str(mixer).splitlines() == [
        "check_mixer('mamba'):",
        "  ok   shape: (2, 5, 8)",
        "  FAIL grid: kl differs",
        "  skip state: no state site",
    ]
    assert mixer.failed == [checks[1]]
    assert str(TaskReport("ar")).splitlines() == ["check_task('ar'):"]
    error = MixerCheckError(mixer)
    assert error.report is mixer and str(error) == str(mixer)
    assert isinstance(error, AssertionError)


@pytest.fixture(scope="module")
def grid_case():
    task = make_task("ar", num_pairs=4, num_keys=16)
    torch.manual_seed(0)
    model = build_model("mamba", task.vocab_size, d_model=16, max_len=task.max_document_length)
    batch = task.sample(4, seed=0, split="dev")
    return model.eval(), batch, task.corrupt(batch, "key", seed=0)


def test_the_grid_check_passes_where_the_grid_equals_the_loop(grid_case):
    check = grid_against_loop(*grid_case, atol=1e-5, rtol=1e-4, passed="cells agree")
    assert check.name == "grid" and check.passed is True
    assert check.detail.endswith("cells agree") and int(check.detail.split()[0]) > 0


def test_the_grid_check_names_the_column_and_the_cells_that_differ(grid_case, monkeypatch):
    real = report_module.per_cell_loop

    def shifted(*args, **kwargs):  # the loop's KL off by 0.01 in every cell
        table = real(*args, **kwargs)
        return table.assign(kl=table["kl"] + 0.01)

    monkeypatch.setattr(report_module, "per_cell_loop", shifted)
    check = grid_against_loop(*grid_case, atol=1e-5, rtol=1e-4, passed="")
    assert check.passed is False and check.detail == "kl differs from the per-cell loop by 1.00e-02"

    def fewer(*args, **kwargs):  # a cell missing from the loop
        return real(*args, **kwargs).iloc[1:]

    monkeypatch.setattr(report_module, "per_cell_loop", fewer)
    check = grid_against_loop(*grid_case, atol=1e-5, rtol=1e-4, passed="")
    assert check.passed is False and "grid cells against" in check.detail
