"""Probes: a finished run is reused only for its own config; the whole config is validated
before anything is written, so a typo leaves the folder clean; the fields that change nothing a
run computes (progress, max_nonfinite_steps) neither rename nor refuse a run."""

from __future__ import annotations

import json

import pytest

from mecheval import cli
from mecheval.config import ConfigError
from mecheval.sweep import run_name
from mecheval.train.config import identity
from mecheval.train.loop import train
from tests.helpers import TINY, tiny

pytestmark = pytest.mark.reliability


def test_finished_run_of_another_config_is_refused_by_name(tmp_path):
    run = tmp_path / "run"
    first = train(tiny("steps=2"), run)
    stamp = (run / "result.json").stat().st_mtime_ns
    with pytest.raises(ConfigError, match="finished run with a different config") as error:
        train(tiny("steps=2", "arch=mamba"), run)
    assert str(run) in str(error.value) and "model.arch" in str(error.value)
    assert (run / "result.json").stat().st_mtime_ns == stamp
    # Its own config still gets its result back, untouched.
    assert train(tiny("steps=2"), run) == first


def test_cli_train_on_a_finished_folder_of_another_arch_fails(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["train", "--out", str(out), *TINY, "steps=2"]) == 0
    code = cli.main(["train", "--out", str(out), *TINY, "steps=2", "arch=mamba"])
    assert code == 2
    assert "different config" in capsys.readouterr().err
    assert json.loads((out / "result.json").read_text())["config"]["model"]["arch"] == "attention"


@pytest.mark.parametrize(
    "typo,named",
    [
        ("arch=mambaa", "unknown arch 'mambaa'"),
        ("model.options.d_conv=99", "d_conv"),
        ("model.options.d_cnov=3", "d_cnov"),
        ("task.options.num_kyes=16", "num_kyes"),
        ("task.name=arr", "unknown task 'arr'"),
        ("device=cuda:99", "cuda:99"),
        ("device=gpu", "gpu"),
    ],
)
def test_a_config_typo_writes_nothing_and_the_fixed_command_runs(tmp_path, typo, named):
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=named):
        train(tiny("steps=2", "arch=mamba", typo), run)
    assert not run.exists()
    assert train(tiny("steps=2", "arch=mamba"), run)["steps"] == 2


def test_cli_config_typo_is_a_config_error_and_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "cli"
    assert cli.main(["train", "--out", str(out), *TINY, "steps=2", "arch=mambaa"]) == 2
    assert "mambaa" in capsys.readouterr().err
    assert not out.exists()


def test_divergence_guard_and_progress_are_not_part_of_a_runs_identity(tmp_path):
    config = tiny("steps=2")
    other = config.replace(max_nonfinite_steps=10, progress=True)
    assert identity(config) == identity(other)
    assert run_name(config) == run_name(other)
    first = train(config, tmp_path / "run")
    assert train(other, tmp_path / "run") == first
    # Old run folders keep their names: the identity holds no new field.
    assert "max_nonfinite_steps" not in identity(config)
