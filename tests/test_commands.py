"""Probes: `report` on a mistyped path creates nothing; report.html escapes names taken from run
folders; `--retries -1` is refused; files get the user's umask; temporaries left by a kill are
cleaned when the run resumes."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from mecheval import cli
from mecheval.config import ConfigError
from mecheval.evaluation.report import build_report
from mecheval.io import atomic_write_text
from mecheval.sweep import expand_sweep, run_sweep
from mecheval.train.loop import train
from tests.helpers import tiny

pytestmark = pytest.mark.reliability


def test_report_on_a_mistyped_path_creates_no_folder(tmp_path, capsys):
    missing = tmp_path / "runs" / "mian"
    with pytest.raises(FileNotFoundError, match="no finished run"):
        build_report(missing)
    assert cli.main(["report", str(missing)]) == 1
    assert "no finished run" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_report_html_escapes_a_run_folder_named_with_a_script_tag(tmp_path):
    train(tiny("steps=2"), tmp_path / "runs" / "plain")
    evil = "x<script>alert(1)<"
    shutil.copytree(tmp_path / "runs" / "plain", tmp_path / "runs" / evil)
    out = build_report(tmp_path / "runs")
    page = (out / "report.html").read_text()
    assert "<script" not in page.lower()
    assert "x&lt;script&gt;alert(1)&lt;" in page


def test_negative_retries_are_refused(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text("base: {steps: 1}\ngrid: {seed: [1]}\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sweep", str(sweep), "--out", str(tmp_path / "out"), "--retries", "-1"])
    assert exit_.value.code == 2
    assert "--retries: must be >= 0, got -1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    runs = expand_sweep({"base": {"steps": 1}, "grid": {"seed": [1]}})
    with pytest.raises(ConfigError, match="retries must be >= 0, got -1"):
        run_sweep(runs, tmp_path / "out", retries=-1, progress=False)
    with pytest.raises(ConfigError, match="workers must be >= 1, got 0"):
        run_sweep(runs, tmp_path / "out", workers=0, progress=False)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_written_files_get_the_users_umask(tmp_path, umask):
    previous = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "a.txt", "x")
        run = tmp_path / "run"
        train(tiny("steps=2"), run)
    finally:
        os.umask(previous)
    expected = 0o666 & ~umask
    for path in [
        tmp_path / "a.txt",
        run / "result.json",
        run / "config.yaml",
        run / "metrics.parquet",
        run / "checkpoints" / "latest",
        run / "checkpoints" / "step_000000002" / "model.safetensors",
    ]:
        assert stat.S_IMODE(path.stat().st_mode) == expected, path
    cached = list((tmp_path / "cache").rglob("*.safetensors"))  # the task's dataset cache
    assert cached and all(stat.S_IMODE(p.stat().st_mode) == expected for p in cached)


def test_temporaries_left_by_a_kill_are_removed_on_resume(tmp_path):
    run = tmp_path / "run"
    train(tiny(), run)
    (run / "result.json").unlink()
    strays = [
        run / ".tmp-result.json-abc123",  # this version's atomic writes
        run / ".metrics.parquet.x1y2.tmp",  # earlier versions' atomic writes
        run / "checkpoints" / ".tmp-latest-zz9",
    ]
    for path in strays:
        path.write_text("half")
    (run / "checkpoints" / ".tmp-step_000000010-4242").mkdir()
    (run / "checkpoints" / ".tmp-step_000000010-4242" / "model.safetensors").write_text("x")
    train(tiny(), run)
    for path in [*strays, run / "checkpoints" / ".tmp-step_000000010-4242"]:
        assert not path.exists(), path
    left = [p.name for p in [*run.iterdir(), *(run / "checkpoints").iterdir()]]
    assert not [name for name in left if "tmp" in name]
