"""A task of one's own, named by import path, through the command line: `mecheval train`,
`evaluate`, `report` and `data stats` work on it unchanged (examples/successor.py: one file,
no key-value pairs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import pytest

from mecheval import cli
from tests.helpers import cli_line

pytestmark = pytest.mark.pipeline

TASK = "examples.successor:SuccessorRecall"
SMALL = ["task.options.length=8", "task.options.num_tokens=24", "task.train_size=320"]
TINY = ["task.eval_size=32", "d_model=16", "progress=false", "backend=torch", "device=cpu"]


def test_train_evaluate_and_report_an_own_task(tmp_path, capsys):
    run = tmp_path / "runs" / "own"
    steps = ["steps=4", "eval_every=2", "checkpoint_every=2", "arch=attention"]
    assert cli.main(["train", "--out", str(run), f"task.name={TASK}", *SMALL, *TINY, *steps]) == 0
    assert cli.main(["evaluate", str(run)]) == 0
    table = pd.read_parquet(run / "interventions.parquet")
    assert set(table.corruption) == {"key", "value"}
    assert set(table.position) == {"key", "value", "divider", "query", "value+1", "value+2"}
    assert set(table.task) == {"successor(length=8, num_tokens=24)"}
    assert table.p_restored.between(0, 1).all()
    examples = pd.read_parquet(run / "examples.parquet")
    assert len(examples) == 32 and (examples.distance > 0).all()
    assert cli.main(["report", str(tmp_path / "runs")]) == 0
    report = (tmp_path / "runs" / "report" / "report.md").read_text()
    assert "successor(length=8, num_tokens=24)" in report
    capsys.readouterr()
    assert cli.main(["data", "stats", "--task", TASK, "length=8", "--n", "50"]) == 0
    assert "successor(length=8)" in capsys.readouterr().out


def test_a_task_that_no_longer_imports_is_a_one_line_config_error(tmp_path, monkeypatch, capsys):
    """Trained in the folder that holds its module, evaluated from another."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # the registry adds the folder it ran in
    (tmp_path / "mine").mkdir()
    source = (Path(__file__).parents[1] / "examples" / "successor.py").read_text()
    (tmp_path / "mine" / "mytask.py").write_text(source)
    monkeypatch.chdir(tmp_path / "mine")
    run = tmp_path / "mine" / "run"
    argv = ["train", "--out", str(run), "task.name=mytask:SuccessorRecall", *SMALL, *TINY]
    assert cli.main([*argv, "steps=2", "arch=attention"]) == 0
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "mytask")
    sys.path.remove(str(tmp_path / "mine"))
    code, line = cli_line(["evaluate", str(run)], capsys)
    assert code == 2
    assert line == (
        "mecheval: config error: task: 'mytask:SuccessorRecall': cannot import 'mytask' (No "
        "module named 'mytask'); run from the folder that holds it, or put that folder on "
        "PYTHONPATH"
    )
