"""Probes: every evaluation option is checked before any work starts, against the run's task,
and a bad one ends `mecheval evaluate` (and `mecheval run`, before it trains) with one line
naming the option, the bad value and what is allowed; a position that lies outside some
documents is patched in the others only, and the documents it skipped are counted."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mecheval.evaluation.config import OptionError
from mecheval.evaluation.evaluate import evaluate_run
from mecheval.tasks import make_task
from mecheval.train.loop import train
from tests.helpers import cli_line, tiny

pytestmark = pytest.mark.reliability

# The tiny task: 4 pairs over 16 keys, documents of 13 tokens, values at 2, 4, 6 or 8.
TASK = "ar(num_pairs=4, num_keys=16)"

PROBES = [
    (
        ["--positions", "key", "nosuch"],
        "--positions: 'nosuch' is not a position of ar's documents: use its roles (key, value, "
        "divider, query, answer), optionally shifted (value+1, key-1), an index (0, 1, ...), "
        "or all",
    ),
    (
        ["--positions", "qurey"],
        "--positions: 'qurey' is not a position of ar's documents",
    ),
    (
        ["--positions", "value+99"],
        f"--positions: 'value+99' lies outside every dev document of {TASK} (value+k lies "
        "inside some of them for k from -8 to +10)",
    ),
    (
        ["--positions", "13"],
        f"--positions: 13 lies past the end of every dev document of {TASK} (the longest has "
        "13 tokens)",
    ),
    (
        ["--corruptions", "query"],
        "--corruptions: 'query' is not a corruption of ar: use key and/or value",
    ),
    (["--seed", "-5"], "--seed: must be >= 0, got -5"),
    (["--split", "bogus"], "--split: must be dev or test, got 'bogus'"),
    (["--device", "gpu0"], "--device: 'gpu0' is not a device: use auto, cpu, cuda or cuda:N"),
    (["--memory-budget", "0"], "--memory-budget: must be >= 1, got 0"),
    (["--step", "-3"], "--step: must be a step number >= 0 or 'latest', got -3"),
]


@pytest.mark.parametrize("options,expected", PROBES, ids=[" ".join(o) for o, _ in PROBES])
def test_a_bad_evaluate_option_is_one_line_naming_it(tmp_path, capsys, options, expected):
    run = tmp_path / "run"
    train(tiny("steps=2"), run)
    code, line = cli_line(["evaluate", str(run), *options], capsys)
    assert code == 2
    assert line.startswith(f"mecheval: config error: {expected}"), line
    assert not (run / "interventions.parquet").exists()


def test_a_step_that_is_no_number_is_refused_by_the_parser(tmp_path, capsys):
    code, line = cli_line(["evaluate", str(tmp_path), "--step", "last"], capsys)
    assert code == 2
    assert "argument --step: expected a step number or 'latest', got 'last'" in line


def _run_config(tmp_path, evaluate: str):
    path = tmp_path / "run.yaml"
    path.write_text(
        "sweep:\n"
        "  base: {task: {options: {num_pairs: 4, num_keys: 16}, train_size: 320, "
        "eval_size: 32}, model: {d_model: 16}, steps: 2, progress: false, backend: torch, "
        "device: cpu}\n"
        "  grid: {seed: [0]}\n"
        f"evaluate: {evaluate}\n"
        "workers: 1\n"
    )
    return path


@pytest.mark.parametrize(
    "evaluate,expected",
    [
        ("{positions: [key, nosuch]}", "evaluate.positions: 'nosuch' is not a position of"),
        ("{positions: [value+99]}", "evaluate.positions: 'value+99' lies outside every dev"),
        ("{seed: -5}", "evaluate.seed: must be >= 0, got -5"),
    ],
)
def test_the_main_job_refuses_a_bad_evaluate_section_before_training(
    tmp_path, capsys, evaluate, expected
):
    out = tmp_path / "out"
    code, line = cli_line(["run", str(_run_config(tmp_path, evaluate)), "--out", str(out)], capsys)
    assert code == 2
    assert line.startswith(f"mecheval: config error: {expected}"), line
    assert not out.exists()  # nothing trained


def test_a_position_outside_some_documents_is_skipped_there_and_counted(tmp_path, capsys):
    """key-2 lies before the start of the documents whose queried key is the first (key = 1):
    it is patched in the others only, and the skipped ones are counted."""
    run = tmp_path / "run"
    train(tiny("steps=2"), run)
    table = evaluate_run(run, positions=["key", "key-2"], corruptions=["key"])
    batch = make_task("ar", num_pairs=4, num_keys=16).dataset("dev", size=32)
    key = batch.positions["key"].numpy()
    outside = key - 2 < 0  # the oracle, from the documents themselves
    assert 0 < outside.sum() < len(key)
    shifted = table[table["position"] == "key-2"]
    assert set(shifted["example"]) == set(np.flatnonzero(~outside))
    np.testing.assert_array_equal(shifted["position_index"], key[shifted["example"]] - 2)
    # Each row is its own document's: the clean run's probability is the same at every cell.
    clean = table[table["position"] == "key"].groupby("example")["p_original"].first()
    np.testing.assert_allclose(shifted["p_original"], clean[shifted["example"]].to_numpy())
    assert set(table.loc[table["position"] == "key", "example"]) == set(range(32))
    stamp = json.loads((run / "interventions.json").read_text())
    assert stamp["documents"] == 32 and stamp["skipped"] == {"key-2": int(outside.sum())}
    code = _evaluate_cli(run, capsys, "--positions", "key", "key-2", "--corruptions", "key")
    assert f"32 documents (key-2 lies outside {int(outside.sum())}: skipped there)" in code


def _evaluate_cli(run, capsys, *options) -> str:
    from mecheval import cli

    assert cli.main(["evaluate", str(run), *options]) == 0
    return capsys.readouterr().out


def test_options_are_checked_in_python_too(tmp_path):
    run = tmp_path / "run"
    train(tiny("steps=2"), run)
    with pytest.raises(OptionError, match="positions: 'qurey' is not a position of ar's"):
        evaluate_run(run, positions=["key", "qurey"])
    with pytest.raises(OptionError, match="corruptions: expected a non-empty list"):
        evaluate_run(run, corruptions=[])
    assert not (run / "interventions.parquet").exists()
