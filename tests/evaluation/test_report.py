"""Probes: the report accounts for every run folder it finds (finished, diverged with its step
and reason, failed, incomplete, unreadable) in a table of its own, and its Findings and
accuracy tables say how many runs they rest on; a stored table that cannot be read stops it
with one line naming the file."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch.nn.functional as F

from mecheval.config import to_dict
from mecheval.evaluation.evaluate import evaluate_run
from mecheval.evaluation.report import build_report
from mecheval.sweep.runner import run_one
from mecheval.train.loop import train
from tests.helpers import TINY, cli_line, tiny

pytestmark = pytest.mark.reliability


def _nan_loss_from(monkeypatch, first: int) -> None:
    """Every training loss from step `first` on (1-based) is NaN (its gradients are not)."""
    real, calls = F.cross_entropy, []

    def cross_entropy(logits, target, *args, **kwargs):
        loss = real(logits, target, *args, **kwargs)
        if logits.requires_grad:
            calls.append(1)
            if len(calls) >= first:
                return loss + loss.detach() * math.nan
        return loss

    monkeypatch.setattr("mecheval.train.steps.F.cross_entropy", cross_entropy)


def _run_folders(tmp_path, monkeypatch):
    """runs/: one run of each status (one finished run, evaluated)."""
    runs = tmp_path / "runs"
    train(tiny(), runs / "a-finished")
    evaluate_run(runs / "a-finished", positions=["key", "value", "query"], corruptions=["key"])
    train(tiny("seed=1"), runs / "b-unreadable")
    (runs / "b-unreadable" / "result.json").write_text("{")
    train(tiny("seed=2"), runs / "c-incomplete")
    (runs / "c-incomplete" / "result.json").unlink()  # stopped after its last checkpoint
    with monkeypatch.context() as patch:  # as a sweep records them: error.json
        _nan_loss_from(patch, first=6)
        assert run_one(to_dict(tiny("seed=3")), str(runs / "d-diverged"))["status"] == "failed"

        def broken(config, run_dir):
            raise OSError("No space left on device")

        patch.setattr("mecheval.sweep.runner.train", broken)
        assert run_one(to_dict(tiny("seed=4")), str(runs / "e-failed"))["status"] == "failed"
    return runs


def test_the_report_accounts_for_every_run_folder(tmp_path, monkeypatch):
    runs = _run_folders(tmp_path, monkeypatch)
    out = build_report(runs)
    folders = pd.read_parquet(out / "run_folders.parquet").set_index("run")
    assert folders["status"].to_dict() == {
        "a-finished": "finished",
        "b-unreadable": "unreadable",
        "c-incomplete": "incomplete",
        "d-diverged": "diverged",
        "e-failed": "failed",
    }
    # Steps: the run's; the newest checkpoint of a stopped run; the first non-finite step.
    steps = {run: None if pd.isna(step) else int(step) for run, step in folders["step"].items()}
    assert steps == {
        "a-finished": 8,
        "b-unreadable": None,
        "c-incomplete": 8,
        "d-diverged": 6,
        "e-failed": None,
    }
    assert folders.loc["a-finished", "evaluated"] == 8
    assert "the loss was nan for 3 consecutive steps (6..8" in folders.loc["d-diverged", "detail"]
    assert "result.json" in folders.loc["b-unreadable", "detail"]
    assert "OSError: No space left on device" in folders.loc["e-failed", "detail"]
    text = (out / "report.md").read_text()
    assert (
        f"Run folders under `{runs}`: 5 (1 finished, 1 diverged, 1 failed, 1 incomplete, "
        "1 unreadable)." in text
    )
    assert (
        "These verdicts rest on 1 2-layer model(s), 1 of them evaluated: the best learning "
        "rate of each, among the 1 finished run(s) of the 5 run folder(s)" in text
    )
    assert "1 model(s), each the best of its learning rates among the 1 finished run(s)" in text
    section = text.split("## Run folders")[1].split("##")[0]
    for run in folders.index:
        assert f"| {run} | {folders.loc[run, 'status']} |" in section


def test_a_truncated_interventions_table_stops_the_report_in_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny("steps=2"), run)
    evaluate_run(run, positions=["key"], corruptions=["key"])
    table = run / "interventions.parquet"
    table.write_bytes(table.read_bytes()[:300])
    code, line = cli_line(["report", str(run)], capsys)
    assert code == 1
    assert line.startswith(
        f"mecheval: error: {table}: not the file interventions.json names (another sha256"
    )
    assert line.endswith(f"evaluate the run again: mecheval evaluate {run} --force")
    assert not (run / "report" / "report.md").exists()
    # Evaluating again mends it.
    evaluate_run(run, positions=["key"], corruptions=["key"])
    assert (build_report(run) / "report.md").exists()
    assert json.loads((run / "interventions.json").read_text())["documents"] == 32


def test_a_run_trained_alone_that_diverged_is_reported_diverged(tmp_path, monkeypatch, capsys):
    """`mecheval train` (no sweep) records its divergence in error.json as a sweep does, so
    the run folder table says diverged, with the step, not incomplete."""
    from mecheval.run_folder.status import status_table

    run = tmp_path / "runs" / "diverged"
    _nan_loss_from(monkeypatch, first=6)
    steps = ["steps=8", "checkpoint_every=2", "log_every=2", "eval_every=4"]
    code, line = cli_line(["train", "--out", str(run), *TINY, *steps], capsys)
    assert code != 0 and "the loss was nan" in line
    row = status_table(tmp_path / "runs").set_index("run").loc["diverged"]
    assert row["status"] == "diverged" and row["step"] == 6
