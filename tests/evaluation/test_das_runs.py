"""`mecheval das` on run folders (mecheval.evaluation.das_runs): every user error is a one-line
error before any run's work starts; the learned bases are saved with the table and loadable,
and patching with them gives the table's results; the settings stamp holds every default as
its value, and a kill between the table and its stamp never serves the table for other
settings."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest
import torch

from mecheval import cli
from mecheval.evaluation.config import EvaluateConfig
from mecheval.evaluation.das_runs import bases_key, read_bases
from mecheval.evaluation.documents import evaluation_documents
from mecheval.run_folder import files
from mecheval.run_folder.weights import load_trained_model
from tests.helpers import TINY, cli_line

FAST = ["--steps", "2", "--lr", "0.05"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two tiny finished runs (2 layers, d_model 16): attention and Mamba."""
    root = tmp_path_factory.mktemp("das_runs")
    runs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MECHEVAL_CACHE", str(root / "cache"))
        for arch in ("attention", "mamba"):
            run = root / arch
            argv = ["train", "--out", str(run), *TINY, "steps=8", "eval_every=4", f"arch={arch}"]
            argv += ["model.options.init=pytorch"]
            assert cli.main(argv) == 0
            runs[arch] = run
    return runs


@pytest.fixture
def runs(trained, tmp_path, monkeypatch):
    """Copies of the trained runs under tmp_path/runs (attention first)."""
    monkeypatch.setenv("MECHEVAL_CACHE", str(trained["attention"].parent / "cache"))
    for arch, run in trained.items():
        shutil.copytree(run, tmp_path / "runs" / f"{'ab'[arch == 'mamba']}_{arch}")
    return tmp_path / "runs"


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--layers", "5"], "--layers: a_attention has layers 0..1, got [5]"),
        (["--holdout", "0.01"], "--holdout: a_attention, positions key, value, query: holdout "
                                "0.01 of 32 documents holds none out: raise it"),
        (["--dims", "1000"], "--dims: a_attention: dims [1000]: larger than every site's width"),
        (["--sites", "block_input,stat"], "--sites: a_attention's model has no ['stat'] in layers"),
        (["--sites", "state"], "--sites: a_attention's model has no ['state'] in layers [0, 1]"),
    ],
    ids=["layers", "holdout", "dims", "misspelt-site", "absent-site"],
)  # fmt: skip
def test_every_user_error_is_one_line_before_any_work(runs, capsys, flags, words):
    """Before: --layers 5 and --holdout 0.01 ended in "internal error", exit 3; --dims 1000 was
    dropped silently while das.json recorded it; a misspelt site among good ones was ignored.
    Each is checked for every run before the first run's work."""
    code, line = cli_line(["das", str(runs), *FAST, *flags], capsys)
    assert code == 2
    assert words in line, line
    assert not list(runs.glob("*/das.*"))  # no run was searched


def test_the_bases_are_saved_and_patching_with_them_gives_the_table(runs, capsys):
    run = runs / "b_mamba"
    argv = ["das", str(run), "--sites", "block_input,state", "--layers", "1", "--dims", "2,64"]
    assert cli.main([*argv, "--positions", "value,query", *FAST]) == 0
    out = capsys.readouterr().out
    assert "b_mamba: k 64 left out at layers.1.block_input (its width is less)" in out
    stamp = json.loads((run / "das.json").read_text())
    assert stamp["left_out"] == {"layers.1.block_input": [64]}  # named, not dropped silently
    assert stamp["settings"]["dims"] == [2, 64]
    bases = read_bases(run)
    assert set(bases) == {
        bases_key("key", f"layers.1.{site}", position, k)
        for site, ks in (("block_input", [2]), ("state", [2, 64]))  # the state: 32 x 16 floats
        for position in ("value", "query")
        for k in ks
    }
    for R in bases.values():
        torch.testing.assert_close(R.T @ R, torch.eye(R.shape[1]), atol=1e-5, rtol=0)
    # An independent oracle: patch layer 1's input at the value with the saved basis through
    # the model's own `intervene`, on the held-out documents, and read p(answer) at the query.
    table = pd.read_parquet(run / "das.parquet")
    rows = table[(table["site"] == "block_input") & (table["position"] == "value")]
    rows = rows[rows["k"] == 2].sort_values("example")
    model, task, config = load_trained_model(run)
    options = EvaluateConfig(corruptions=["key"], positions=["value", "query"])
    documents = evaluation_documents(task, config.task.eval_size, options)
    held = torch.tensor(rows["example"].to_numpy())
    batch, corrupted = documents.batch, documents.corrupted["key"]
    value = batch.positions["value"][held]
    name = "layers.1.block_input"
    with torch.no_grad():
        with model.intervene(reads={name: value}) as clean:
            model(batch.tokens[held])
        with model.intervene(reads={name: value}) as corrupted_reads:
            model(corrupted[held])
        R = bases[bases_key("key", name, "value", 2)]
        patched = corrupted_reads[name] + (clean[name] - corrupted_reads[name]) @ R @ R.T
        with model.intervene(patches={name: (value, patched)}):
            logits = model(corrupted[held])
    at = logits[torch.arange(len(held)), batch.positions["query"][held]]
    p = at.softmax(-1)[torch.arange(len(held)), batch.answers[held]]
    want = torch.tensor(rows["p_target"].to_numpy(), dtype=torch.float64)
    torch.testing.assert_close(p.double(), want, atol=1e-5, rtol=1e-4)


def test_the_stamp_holds_every_default_as_its_value(runs):
    """Before: das.json stored null for defaulted settings, so a changed default reused old
    tables."""
    run = runs / "a_attention"
    assert cli.main(["das", str(run), "--positions", "value", *FAST]) == 0
    settings = json.loads((run / "das.json").read_text())["settings"]
    assert None not in settings.values()
    assert settings | {"checkpoint": None} == {
        "sites": ["block_input", "mixer_output"],  # those of the default ones it has
        "layers": [0, 1],
        "positions": ["value"],
        "dims": [1, 2, 4, 8],  # the default sizes below the widest site's width, 16
        "corruptions": ["key"],
        "split": "dev",
        "steps": 2,
        "lr": 0.05,
        "batch_size": 64,
        "holdout": 0.5,
        "seed": 0,
        "checkpoint": None,
    }


def test_a_kill_between_the_table_and_its_stamp_never_serves_other_settings(
    runs, monkeypatch, capsys
):
    """Before: a kill after das.parquet of `--dims 2` and before its das.json left the
    `--dims 1` stamp beside it, and the next `--dims 1` read the `--dims 2` table back."""
    run = runs / "a_attention"
    base = ["das", str(run), "--sites", "block_input", "--layers", "1", "--positions", "value"]
    assert cli.main([*base, "--dims", "1", *FAST]) == 0
    written = files.atomic_write_json

    def killed(path, data):
        if path.name == files.DAS_STAMP:
            raise KeyboardInterrupt  # the kill, after the table and the bases
        written(path, data)

    monkeypatch.setattr(files, "atomic_write_json", killed)
    assert cli.main([*base, "--dims", "2", *FAST]) == 130
    monkeypatch.setattr(files, "atomic_write_json", written)
    assert set(pd.read_parquet(run / "das.parquet")["k"]) == {0, 2, 16}  # --dims 2's table
    with pytest.raises(files.StaleFileError, match="not the file das.json names"):
        files.read_table(run, files.DAS)
    assert cli.main([*base, "--dims", "1", *FAST]) == 0
    assert set(pd.read_parquet(run / "das.parquet")["k"]) == {0, 1, 16}
    assert set(read_bases(run)) == {bases_key("key", "layers.1.block_input", "value", 1)}


def test_a_kill_between_the_grids_and_their_stamp_never_serves_other_positions(runs, monkeypatch):
    """Before: interventions.parquet held `value` while interventions.json said key and
    query, and the next evaluation of key and query read it back."""
    from mecheval.evaluation.evaluate import evaluate_run

    run = runs / "a_attention"
    evaluate_run(run, positions=["key", "query"], corruptions=["key"])
    written = files.atomic_write_json

    def killed(path, data):
        if path.name == files.INTERVENTIONS_STAMP:
            raise KeyboardInterrupt
        written(path, data)

    monkeypatch.setattr(files, "atomic_write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        evaluate_run(run, positions=["value"], corruptions=["key"])
    monkeypatch.setattr(files, "atomic_write_json", written)
    assert set(pd.read_parquet(run / "interventions.parquet")["position"]) == {"value"}
    table = evaluate_run(run, positions=["key", "query"], corruptions=["key"])
    assert set(table["position"]) == {"key", "query"}
    assert set(files.read_table(run, files.INTERVENTIONS)["position"]) == {"key", "query"}
