"""Probes: the CLI ends every error a user can fix in one line naming it and a non-zero exit (a
folder in use, `--out` under a regular file or on one, MECHEVAL_CACHE naming a file); a bug gets
one line saying so, and its traceback only with `--debug`."""

from __future__ import annotations

import pytest

from mecheval import cli
from mecheval.config import ConfigError
from mecheval.io import exclusive_lock
from mecheval.train.loop import train
from tests.helpers import TINY, cli_line, tiny

pytestmark = pytest.mark.reliability


def test_a_second_train_on_a_folder_in_use_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    with exclusive_lock(out / ".lock"):  # as a first `mecheval train` holds it
        code, line = cli_line(["train", "--out", str(out), *TINY, "steps=2"], capsys)
    assert code == 1
    assert line == f"mecheval: error: {out} is in use by another process"
    assert not (out / "result.json").exists()


@pytest.mark.parametrize("command", ["train", "sweep", "run", "report"])
def test_out_under_a_regular_file_is_one_line(tmp_path, capsys, command):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a folder")
    out = blocker / "runs"
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("base: {steps: 1}\ngrid: {seed: [1]}\n")
    arguments = {
        "train": ["train", *TINY, "steps=2"],
        "sweep": ["sweep", str(sweep)],
        "run": ["run"],
        "report": ["report", str(tmp_path)],
    }[command]
    code, line = cli_line([*arguments, "--out", str(out)], capsys)
    assert code == 2
    assert line == (
        f"mecheval: config error: --out: {out} lies under {blocker}, which is a file; give a folder"
    )


def test_report_out_on_an_existing_file_is_one_line(tmp_path, capsys):
    run = tmp_path / "run"
    train(tiny("steps=2"), run)
    target = tmp_path / "report.md"
    target.write_text("an older report")
    code, line = cli_line(["report", str(run), "--out", str(target)], capsys)
    assert code == 2
    assert line == f"mecheval: config error: --out: {target} is a file; give a folder"
    assert target.read_text() == "an older report"


@pytest.mark.parametrize("where", ["file", "under-file"])
def test_a_cache_that_is_a_file_is_one_line_and_trains_nothing(
    tmp_path, capsys, monkeypatch, where
):
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    cache = blocker if where == "file" else blocker / "tasks"
    monkeypatch.setenv("MECHEVAL_CACHE", str(cache))
    out = tmp_path / "run"
    code, line = cli_line(["train", "--out", str(out), *TINY, "steps=2"], capsys)
    assert code == 1
    problem = "is a file" if where == "file" else f"lies under {blocker}, which is a file"
    assert line == (
        f"mecheval: error: MECHEVAL_CACHE={cache} {problem}; the dataset cache needs a folder "
        "(set MECHEVAL_CACHE to one)"
    )
    assert not out.exists()


def test_a_bug_is_one_line_and_its_traceback_only_with_debug(tmp_path, capsys, monkeypatch):
    def broken(path, out=None, allow_code_change=False):
        raise TypeError("an unexpected argument")

    monkeypatch.setattr("mecheval.evaluation.report.build_report", broken)
    code, line = cli_line(["report", str(tmp_path)], capsys)
    assert code == 3
    assert line == (
        "mecheval: internal error (a bug; please report it): TypeError: an unexpected "
        "argument. Run again with --debug for its traceback."
    )
    with pytest.raises(TypeError, match="an unexpected argument"):
        cli.main(["--debug", "report", str(tmp_path)])


def test_debug_shows_an_expected_error_as_it_is_raised(tmp_path):
    with pytest.raises(ConfigError, match="seed: must be >= 0, got -5"):
        cli.main(["--debug", "evaluate", str(tmp_path), "--seed", "-5"])
