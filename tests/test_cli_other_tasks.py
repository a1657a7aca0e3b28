"""The tasks beyond the study's, through the command line as the study's go: MQAR (several
answers per document) and MAD's fuzzy recall (roles of several tokens, training on every next
token) train, evaluate, search with DAS and report; their read-outs are the roles'."""

from __future__ import annotations

import pandas as pd
import pytest

from mecheval import cli

pytestmark = pytest.mark.pipeline

COMMON = ["task.train_size=64", "task.eval_size=16", "d_model=16", "progress=false",
          "backend=torch", "device=cpu", "steps=4", "eval_every=2"]  # fmt: skip
TASKS = {
    "mqar": [
        "task.name=mqar",
        "task.options.vocab_size=64",
        "task.options.input_seq_len=32",
        "task.options.num_kv_pairs=4",
    ],  # fmt: skip
    "fuzzy": ["task.name=mad_fuzzy_recall", "task.options.seq_len=48"],
}


@pytest.mark.parametrize("task", list(TASKS))
def test_train_evaluate_das_and_report(tmp_path, task):
    run = tmp_path / "runs" / task
    argv = ["train", "--out", str(run), *TASKS[task], *COMMON, "arch=mamba"]
    assert cli.main(argv) == 0
    assert cli.main(["evaluate", str(run)]) == 0
    grid = pd.read_parquet(run / "interventions.parquet")
    assert set(grid.position) == {"key", "value", "query", "value+1", "value+2"}
    examples = pd.read_parquet(run / "examples.parquet")
    assert examples.document.nunique() == 16 and len(examples) >= 16
    assert grid.example.max() == len(examples) - 1  # a row per (document, answer)
    over = pd.read_parquet(run / "readouts_over_training.parquet")
    assert {"induction", "direct_early", "direct_late"} <= set(over.columns)
    das = ["das", str(run), "--sites", "block_input", "--layers", "1", "--dims", "1",
           "--steps", "2", "--positions", "key,query"]  # fmt: skip
    assert cli.main(das) == 0
    assert cli.main(["report", str(tmp_path / "runs")]) == 0
    report = (tmp_path / "runs" / "report" / "report.md").read_text()
    assert TASKS[task][0].split("=")[1] in report
