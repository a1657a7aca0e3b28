"""DAS on a trained model (the pipeline's attention run, which solves its 4-pair AR by
induction): a few dimensions of layer 1's input at the value carry the association, and
training the basis finds them; `mecheval das` writes the run's table, reads it back when asked
again with the same settings, and `mecheval report` shows k*."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest

from mecheval import cli
from mecheval.interventions.das import DasSettings, das
from mecheval.run_folder.weights import load_trained_model

pytestmark = pytest.mark.pipeline


def test_training_finds_the_subspace(trained):
    run, _ = trained
    model, task, _ = load_trained_model(run)
    batch = task.sample(128, seed=5, split="dev")
    corrupted = task.corrupt(batch, "key", seed=5)
    where = dict(sites=["block_input"], layers=[1], positions=["value"], dims=[4])
    found, _ = das(model, batch, corrupted, settings=DasSettings(steps=60, lr=2e-2), **where)
    start, _ = das(model, batch, corrupted, settings=DasSettings(steps=1, lr=1e-9), **where)

    def iia(table, k):
        return table[table["k"] == k]["correct"].mean()

    assert iia(found, 4) > iia(start, 4) + 0.2
    assert iia(found, 64) == pytest.approx(iia(start, 64))  # the full swap has nothing to learn
    assert iia(found, 64) > 0.8  # and the value carries the answer


def test_the_das_command_and_its_report_section(trained, tmp_path, capsys):
    run = tmp_path / "runs" / "attention"
    shutil.copytree(trained[0], run)
    args = ["das", str(run), "--sites", "block_input", "--layers", "1"]
    args += ["--positions", "value,query", "--dims", "1,4", "--steps", "20", "--lr", "0.02"]
    assert cli.main(args) == 0
    table = pd.read_parquet(run / "das.parquet")
    assert set(table["site"]) == {"block_input"}
    assert set(table["k"]) == {0, 1, 4, 64} and set(table["position"]) == {"value", "query"}
    assert table["example"].nunique() == 64  # half of the run's 128 evaluation documents
    stamp = (run / "das.json").stat().st_mtime_ns
    assert cli.main(args) == 0  # the same settings: read back, not searched again
    assert (run / "das.json").stat().st_mtime_ns == stamp
    assert cli.main(["report", str(tmp_path / "runs")]) == 0
    report = (tmp_path / "runs" / "report" / "report.md").read_text()
    assert "Where the association lives (DAS: k*)" in report
    assert (tmp_path / "runs" / "report" / "das_iia.png").exists()
    k_star = pd.read_parquet(tmp_path / "runs" / "report" / "das_k_star.parquet")
    value = k_star[k_star["position"] == "value"].iloc[0]
    assert value["k_star_low"] <= value["k_star"] <= value["k_star_high"]
    assert value["full_swap_iia"] > 0.8 > value["no_swap_iia"]


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--dims", "0,2"], "--dims: expected subspace sizes >= 1"),
        (["--steps", "0"], "--steps: must be >= 1"),
        (["--sites", "nope"], "--sites: attention's model has no ['nope']"),
        (["--sites", "block_input,state"], "--sites: attention's model has no ['state']"),
        (["--corruptions", "query"], "--corruptions: 'query' is not a corruption of ar"),
    ],
)
def test_bad_das_options_are_one_line_errors(trained, tmp_path, capsys, flags, words):
    run = tmp_path / "attention"
    shutil.copytree(trained[0], run)
    assert cli.main(["das", str(run), *flags]) != 0
    assert words in capsys.readouterr().err
