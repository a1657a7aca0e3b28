"""Sweeps: grid expansion, resume after a kill, failures recorded, Ray equals local."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from mecheval.config import ConfigError
from mecheval.sweep import RESULTS, estimate_sweep, expand_sweep, run_sweep, select_runs

REPO = Path(__file__).resolve().parents[2]
BASE = {
    "task": {
        "name": "ar",
        "options": {"num_pairs": 4, "num_keys": 16},
        "train_size": 320,
        "eval_size": 32,
    },
    "model": {"d_model": 16},
    "steps": 8,
    "eval_every": 4,
    "checkpoint_every": 4,
    "backend": "torch",  # not the Triton interpreter that the test session switches on
}
VOLATILE = ["wall_time_s", "checkpoint"]  # differ between any two executions


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHEVAL_CACHE", str(tmp_path / "cache"))


def _spec(grid: dict, **extra) -> dict:
    return {"base": BASE, "grid": grid, **extra}


def test_grid_expands_as_a_product_with_stable_names():
    runs = expand_sweep(
        _spec({"arch": ["attention", "mamba"], "optim.lr": [1e-3, 3e-3], "seed": [1, 2]})
    )
    assert len(runs) == 8
    assert len({r.name for r in runs}) == 8
    assert {(r.config.model.arch, r.config.optim.lr, r.config.seed) for r in runs} == {
        (a, lr, s) for a in ("attention", "mamba") for lr in (1e-3, 3e-3) for s in (1, 2)
    }
    again = expand_sweep(
        _spec({"arch": ["attention", "mamba"], "optim.lr": [1e-3, 3e-3], "seed": [1, 2]})
    )
    assert [r.name for r in runs] == [r.name for r in again]
    assert runs[0].name.startswith("ar-attention-d16-l2-lr0.001-s1-")


def test_only_selects_grid_rows_and_keeps_their_names():
    runs = expand_sweep(_spec({"arch": ["attention", "mamba"], "optim.lr": [1e-3, 3e-3, 1e-2]}))
    mamba = select_runs(runs, ["arch=mamba"])
    assert [r.name for r in mamba] == [r.name for r in runs if r.config.model.arch == "mamba"]
    two = select_runs(runs, ["model.arch=mamba", "lr=1e-3,1e-2"])
    assert {(r.config.model.arch, r.config.optim.lr) for r in two} == {
        ("mamba", 1e-3),
        ("mamba", 1e-2),
    }
    assert select_runs(runs, ["seed=7"]) == []
    with pytest.raises(ConfigError, match="unknown config key 'model.archh'"):
        select_runs(runs, ["model.archh=mamba"])
    with pytest.raises(ConfigError, match="key=value"):
        select_runs(runs, ["mamba"])


def test_include_entries_add_runs_and_another_task_brings_its_own_options():
    runs = expand_sweep(
        _spec(
            {"arch": ["attention"]},
            include=[
                {"model": {"arch": "h3"}, "seed": 3},
                {
                    "task": {"name": "atr", "options": {"max_rhs_len": 5}},
                    "model": {"arch": "based"},
                },
            ],
        )
    )
    assert [(r.config.task.name, r.config.model.arch) for r in runs] == [
        ("ar", "attention"),
        ("ar", "h3"),
        ("atr", "based"),
    ]
    h3, atr = runs[1].config, runs[2].config
    assert h3.task.options == BASE["task"]["options"] and h3.seed == 3  # merged into the base
    assert atr.task.options == {"max_rhs_len": 5}  # AR's options do not leak into ATR
    assert atr.steps == BASE["steps"] and atr.model.d_model == 16  # the rest of the base stays
    with pytest.raises(ConfigError, match="include entries"):
        expand_sweep(_spec({"arch": ["attention"]}, include=["h3"]))


def test_a_file_of_include_runs_alone_does_not_run_its_base():
    include = [{"model": {"arch": "h3"}, "seed": 3}, {"model": {"arch": "mamba"}}]
    runs = expand_sweep({"base": BASE, "include": include})
    assert [(r.config.model.arch, r.config.seed) for r in runs] == [("h3", 3), ("mamba", 42)]
    assert [r.config.model.arch for r in expand_sweep({"base": BASE})] == ["attention"]


def test_bad_sweep_files_are_refused():
    with pytest.raises(ConfigError, match="grid.arch"):
        expand_sweep(_spec({"arch": "attention"}))
    with pytest.raises(ConfigError, match="unknown sweep file key"):
        expand_sweep({"base": BASE, "grids": {}})
    with pytest.raises(ConfigError, match="optim.lrr"):
        expand_sweep(_spec({"optim.lrr": [1]}))


def test_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path):
    base = {**BASE, "model": {"arch": "mamba", "d_model": 16}}
    runs = expand_sweep({"base": base, "grid": {"model.options": [{}, {"d_conv": 99}]}})
    table = run_sweep(runs, tmp_path, progress=False)
    assert sorted(table["status"]) == ["failed", "finished"]
    failed = table[table["status"] == "failed"].iloc[0]
    assert "d_conv" in failed["error"]
    # --retries reruns only the failed one (it fails again: a config error is deterministic)
    table = run_sweep(runs, tmp_path, retries=1, progress=False)
    assert sorted(table["status"]) == ["failed", "finished"]


def test_killed_sweep_resumes_without_losing_or_duplicating_rows(tmp_path):
    spec = _spec({"arch": ["attention", "mamba", "deltanet", "based"]})
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mecheval.cli", "sweep", str(path), "--out", str(out)], env=env
    )
    deadline = time.time() + 240
    while time.time() < deadline:  # kill it once some but not all runs are finished
        if (out / RESULTS).exists():
            done = (pd.read_parquet(out / RESULTS)["status"] == "finished").sum()
            if 1 <= done < 4:
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = pd.read_parquet(out / RESULTS)
    finished_before = set(before.loc[before["status"] == "finished", "run"])
    assert 1 <= len(finished_before) < 4
    stamps = {run: (out / run / "result.json").stat().st_mtime_ns for run in finished_before}

    done = subprocess.run(
        [sys.executable, "-m", "mecheval.cli", "sweep", str(path), "--out", str(out)],
        env=env,
        timeout=600,
    )
    assert done.returncode == 0
    after = pd.read_parquet(out / RESULTS)
    assert len(after) == 4 and after["run"].is_unique
    assert (after["status"] == "finished").all()
    for run, stamp in stamps.items():  # finished runs were skipped, not retrained
        assert (out / run / "result.json").stat().st_mtime_ns == stamp


def test_workers_and_ray_give_the_same_table_as_local(tmp_path):
    pytest.importorskip("ray")
    runs = expand_sweep(_spec({"arch": ["attention", "mamba"], "seed": [1, 2]}))
    local = run_sweep(runs, tmp_path / "local", progress=False)
    pooled = run_sweep(runs, tmp_path / "pooled", workers=2, progress=False)
    remote = run_sweep(runs, tmp_path / "ray", executor="ray", workers=2, progress=False)
    assert (local["status"] == "finished").all()
    for other in (pooled, remote):
        pd.testing.assert_frame_equal(local.drop(columns=VOLATILE), other.drop(columns=VOLATILE))


@pytest.mark.parametrize("stack", [[], ["--stack"]])
def test_dry_run_prints_grid_size_and_estimate(tmp_path, stack):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(_spec({"arch": ["attention", "mamba"]})))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "mecheval.cli", "sweep", str(path), "--dry-run", "--workers", "2"]
    cmd += stack
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"2 runs in {path}")  # the size first, before measuring
    assert "2 runs; estimated wall time" in done.stdout and "2 worker(s)" in done.stdout
    assert "measuring step times" in done.stderr  # the progress bar
    assert not (tmp_path / "runs").exists()


def test_estimate_measures_each_distinct_model_once(monkeypatch):
    from mecheval.train import timing

    calls = []
    monkeypatch.setattr(timing, "measure_step_time", lambda c: calls.append(c) or 0.01)
    runs = expand_sweep(_spec({"arch": ["attention", "mamba"], "seed": [1, 2], "lr": [1e-3, 3e-3]}))
    estimate = estimate_sweep(runs, workers=4)
    assert len(calls) == 2 and estimate["models_measured"] == 2 and estimate["runs"] == 8
    assert estimate["estimated_wall_s"] == sum(r["estimate_s"] for r in estimate["per_run"]) / 4


def test_cli_executor_flag_and_its_deprecated_name(capsys):
    from mecheval.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["sweep", "grid.yaml"]).executor == "local"
    assert parse(["sweep", "grid.yaml", "--executor", "ray"]).executor == "ray"
    assert parse(["sweep", "grid.yaml", "--backend", "ray"]).executor == "ray"
    assert "--backend is deprecated, use --executor" in capsys.readouterr().err


def test_an_unknown_executor_is_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="executor must be one of"):
        run_sweep([], tmp_path, executor="dask", progress=False)


def test_runs_that_stack_are_grouped_within_the_memory_budget():
    from mecheval.sweep.runner import stacks
    from mecheval.train.loop import training_bytes

    runs = expand_sweep(_spec({"arch": ["attention", "mamba"], "seed": [1, 2], "lr": [1e-3, 3e-3]}))
    groups = stacks(runs, memory=1 << 40)
    assert sorted(len(g) for g in groups) == [4, 4]
    assert all(len({r.config.model.arch for r in g}) == 1 for g in groups)
    mamba = [r for r in runs if r.config.model.arch == "mamba"]
    per_model = training_bytes(mamba[0].config)
    assert [len(g) for g in stacks(mamba, memory=3 * per_model)] == [3, 1]
    assert [run for g in stacks(runs, memory=1) for run in g] != []  # one run per stack at least


def test_a_stacked_sweep_gives_every_run_its_row_and_folder(tmp_path):
    runs = expand_sweep(_spec({"arch": ["mamba"], "seed": [1, 2], "lr": [1e-3, 3e-3]}))
    alone = run_sweep(runs, tmp_path / "alone", progress=False)
    stacked = run_sweep(runs, tmp_path / "stacked", progress=False, stack=True)
    assert (stacked["status"] == "finished").all() and len(stacked) == 4
    assert list(stacked["run"]) == list(alone["run"])
    for run in runs:
        result = yaml.safe_load((tmp_path / "stacked" / run.name / "result.json").read_text())
        assert result["stack_size"] == 4
    # Rerunning skips finished runs, stacked or not.
    again = run_sweep(runs, tmp_path / "stacked", progress=False, stack=True)
    pd.testing.assert_frame_equal(again, stacked)


def test_estimate_times_a_stack_once_and_shares_it(monkeypatch):
    from mecheval.train import timing

    calls = []
    monkeypatch.setattr(timing, "measure_step_time", lambda c: calls.append(1) or 0.01)
    monkeypatch.setattr(
        timing, "measure_stacked_step_time", lambda cs: calls.append(len(cs)) or 0.02
    )
    runs = expand_sweep(_spec({"arch": ["attention", "mamba"], "seed": [1, 2]}))
    estimate = estimate_sweep(runs, workers=1, stack=True)
    assert sorted(calls) == [2, 2]
    assert {r["stack_size"] for r in estimate["per_run"]} == {2}
    assert estimate["total_run_s"] == pytest.approx(2 * 0.02 * runs[0].config.total_steps)


def test_cli_stack_flag():
    from mecheval.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["sweep", "grid.yaml"]).stack is False
    assert parse(["sweep", "grid.yaml", "--stack"]).stack is True


def test_a_bad_folder_in_a_stack_fails_only_its_run(tmp_path):
    runs = expand_sweep(_spec({"arch": ["mamba"], "seed": [1, 2]}))
    bad = tmp_path / runs[1].name
    bad.mkdir(parents=True)
    (bad / "config.yaml").write_text("model: {arch: attention}\n")  # another config's run
    table = run_sweep(runs, tmp_path, progress=False, stack=True)
    status = dict(zip(table["run"], table["status"], strict=True))
    assert status == {runs[0].name: "finished", runs[1].name: "failed"}
    assert "different config" in table.set_index("run").loc[runs[1].name, "error"]
