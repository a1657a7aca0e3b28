"""A pretrained checkpoint through the command line (mecheval/evaluation/pretrained.py):
`mecheval evaluate --model hf:FOLDER --task prompts.yaml --out DIR` writes the run folder, its
accuracies (transformers' own forward the oracle) and its grids (the per-cell loop the
oracle); `mecheval das DIR` and `mecheval report DIR` take it as a trained run. The checkpoint
is a tiny random GPT-2 or Mamba and a word-level tokenizer built here, saved with
save_pretrained: no download."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from mecheval import cli
from mecheval.interventions import per_cell_loop
from mecheval.models.pretrained import from_pretrained
from mecheval.models.pretrained.synthetic import random_hf_model, word_tokenizer
from mecheval.run_folder.files import RESULT_KEYS
from mecheval.tasks import make_task
from tests.helpers import cli_line

pytestmark = pytest.mark.pipeline

NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank"]
CODES = ["12", "47", "53", "88", "31", "64"]
WORDS = ["The", "code", "of", "is", ".", *NAMES, *CODES]
OPTIONS = {"keys": NAMES, "values": CODES, "pairs": 2}
SMALL = ["--eval-size", "12", "--positions", "key", "value", "query"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHEVAL_CACHE", str(tmp_path / "cache"))


def _checkpoint(folder, family: str = "gpt2", seed: int = 0):
    """A random `family` checkpoint with the word tokenizer beside it, in `folder`."""
    word_tokenizer(WORDS, folder)
    hf = random_hf_model(family, d_model=32, n_layers=2, vocab_size=len(set(WORDS)) + 1, seed=seed)
    hf.save_pretrained(folder)
    return hf


def _task_file(path, **options):
    path.write_text(yaml.safe_dump({**OPTIONS, **options}))
    return path


@pytest.mark.parametrize("family", ["gpt2", "mamba"])
def test_evaluate_a_checkpoint_then_das_and_report(tmp_path, family, capsys):
    hf = _checkpoint(tmp_path / "ckpt", family)
    task_file = _task_file(tmp_path / "prompts.yaml")
    out = tmp_path / "runs" / "hf_x"
    argv = ["evaluate", "--model", f"hf:{tmp_path / 'ckpt'}", "--task", str(task_file)]
    assert cli.main([*argv, "--out", str(out), *SMALL]) == 0
    printed = capsys.readouterr().out
    assert f"{out}: hf:{tmp_path / 'ckpt'} ({family}, 2 layers" in printed
    run = yaml.safe_load((out / "pretrained.yaml").read_text())
    assert run["model"] == {"source": f"hf:{tmp_path / 'ckpt'}", "dtype": "float32"}
    assert run["task"]["options"] == {**OPTIONS, "tokenizer": str(tmp_path / "ckpt")}
    result = json.loads((out / "result.json").read_text())
    assert set(RESULT_KEYS) <= set(result) and result["steps"] == 0
    names = ["config.json", "model.safetensors"]
    digests = {n: hashlib.sha256((tmp_path / "ckpt" / n).read_bytes()).hexdigest() for n in names}
    assert result["files"] == digests
    lines = "".join(f"{n} {digests[n]}\n" for n in sorted(names))
    assert result["checkpoint_sha256"] == hashlib.sha256(lines.encode()).hexdigest()

    task = make_task("prompts", tokenizer=str(tmp_path / "ckpt"), **OPTIONS)
    dev = task.dataset("dev", size=12)
    with torch.no_grad():  # transformers' own forward: the answer the argmax at the query
        logits = hf(dev.tokens).logits[torch.arange(12), dev.positions["query"]]
    accuracy = float((logits.argmax(-1) == dev.answers).float().mean())
    assert result["dev_accuracy"] == pytest.approx(accuracy)

    table = pd.read_parquet(out / "interventions.parquet")
    assert set(table.run) == {"hf_x"} and set(table.arch) == {family} and set(table.lr) == {0}
    grid = table[table.corruption == "key"].drop(columns=["corruption", "replacement_ids"])
    corrupted = task.corrupt(dev, "key", seed=0)
    loop = per_cell_loop(from_pretrained(tmp_path / "ckpt"), dev, corrupted, positions=SMALL[3:])
    merged = grid.merge(loop, on=["example", "layer", "site", "position"], suffixes=("", "_loop"))
    assert len(merged) == len(loop) == len(grid)
    for column in ("p_restored", "logit_restored", "kl"):
        np.testing.assert_allclose(merged[column], merged[f"{column}_loop"], atol=1e-5, rtol=1e-4)

    das = ["das", str(out), "--steps", "4", "--dims", "1", "--sites", "block_input"]
    assert cli.main([*das, "--layers", "1", "--positions", "key,query"]) == 0
    searched = pd.read_parquet(out / "das.parquet")
    assert set(searched.arch) == {family} and set(searched.site) == {"block_input"}
    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "runs")]) == 0
    assert "record no code" not in capsys.readouterr().err  # its code status: pretrained
    report = (tmp_path / "runs" / "report" / "report.md").read_text()
    assert "| hf_x |" in report and task.label() in report and "| pretrained |" in report
    runs = pd.read_parquet(tmp_path / "runs" / "report" / "run_folders.parquet")
    assert list(runs.status) == ["finished"] and list(runs.evaluated) == [0]
    k_star = pd.read_parquet(tmp_path / "runs" / "report" / "das_k_star.parquet")
    assert set(k_star.arch) == {family}


def test_evaluated_again_only_when_something_changed(tmp_path):
    _checkpoint(tmp_path / "ckpt")
    task_file = _task_file(tmp_path / "prompts.yaml")
    out = tmp_path / "hf"
    argv = ["evaluate", "--model", f"hf:{tmp_path / 'ckpt'}", "--task", str(task_file)]
    argv += ["--out", str(out), *SMALL]
    assert cli.main(argv) == 0
    written = (out / "interventions.parquet").stat().st_mtime_ns
    assert cli.main(argv) == 0 and cli.main(["evaluate", str(out), *SMALL[2:]]) == 0
    assert (out / "interventions.parquet").stat().st_mtime_ns == written  # read back
    before = json.loads((out / "result.json").read_text())["checkpoint_sha256"]
    _checkpoint(tmp_path / "ckpt", seed=1)  # other weights in the same folder
    assert cli.main(argv) == 0
    after = json.loads((out / "result.json").read_text())["checkpoint_sha256"]
    assert after != before
    assert json.loads((out / "interventions.json").read_text())["settings"]["checkpoint"] == {
        "step": 0,
        "sha256": after,
    }


def test_a_small_budget_splits_the_documents_and_changes_nothing(tmp_path):
    from mecheval.interventions.plan import documents_per_call

    _checkpoint(tmp_path / "ckpt")
    task_file = _task_file(tmp_path / "prompts.yaml")
    tables = {}
    for budget in (1 << 30, 1 << 18):
        out = tmp_path / f"b{budget}"
        argv = ["evaluate", "--model", f"hf:{tmp_path / 'ckpt'}", "--task", str(task_file)]
        argv += ["--out", str(out), *SMALL, "--memory-budget", str(budget)]
        assert cli.main(argv) == 0
        tables[budget] = pd.read_parquet(out / "interventions.parquet").drop(columns="run")
    model = from_pretrained(tmp_path / "ckpt")
    dev = make_task("prompts", tokenizer=str(tmp_path / "ckpt"), **OPTIONS).dataset("dev", size=12)
    assert documents_per_call(model, dev, positions=SMALL[3:], memory_budget=1 << 18) < 12
    keys = ["corruption", "example", "layer", "site", "position"]
    small, large = (t.sort_values(keys).reset_index(drop=True) for t in tables.values())
    pd.testing.assert_frame_equal(small, large, atol=1e-5, rtol=1e-4)


def test_what_cannot_be_done_is_one_line(tmp_path, capsys):
    _checkpoint(tmp_path / "ckpt")
    model = f"hf:{tmp_path / 'ckpt'}"
    task_file = _task_file(tmp_path / "prompts.yaml")
    out = ["--out", str(tmp_path / "out")]
    code, line = cli_line(["evaluate", "--model", model, *out], capsys)
    assert code == 2 and "--model takes --task FILE and --out DIR" in line
    code, line = cli_line(["evaluate"], capsys)
    assert code == 2 and "evaluate takes a run or sweep folder" in line
    code, line = cli_line(["evaluate", "--model", model, "--task", "nope.yaml", *out], capsys)
    assert code == 2 and "--task nope.yaml: no such file" in line
    bad = _task_file(tmp_path / "bad.yaml", keys=[*NAMES[:2], "Zed"])
    code, line = cli_line(["evaluate", "--model", model, "--task", str(bad), *out], capsys)
    assert code == 2 and "key 'Zed' is read as the tokenizer's unknown token" in line
    code, line = cli_line(["evaluate", "--model", model, "--task", str(task_file), *out,
                           "--step", "3"], capsys)  # fmt: skip
    assert code == 2 and "--step: a pretrained checkpoint has no steps" in line
    other = tmp_path / "other"
    _checkpoint(other, seed=2)
    assert cli.main(["evaluate", "--model", model, "--task", str(task_file), *out, *SMALL]) == 0
    again = ["evaluate", "--model", f"hf:{other}", "--task", str(task_file), *out]
    code, line = cli_line(again, capsys)
    assert code == 2 and "holds the run of another checkpoint or task" in line
    small = tmp_path / "small"
    word_tokenizer(WORDS, small)
    random_hf_model("gpt2", d_model=32, n_layers=1, vocab_size=8).save_pretrained(small)
    argv = ["evaluate", "--model", f"hf:{small}", "--task", str(task_file), "--out"]
    code, line = cli_line([*argv, str(tmp_path / "s")], capsys)
    assert code == 2 and "has 18 ids, the model 8: not its tokenizer" in line
