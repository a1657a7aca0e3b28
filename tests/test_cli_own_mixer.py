"""A mixer of one's own, named by import path, through the command line: `mecheval train`,
`evaluate` and `report` work on it unchanged, and a hybrid of it with the zoo's Mamba too."""

from __future__ import annotations

import pandas as pd
import pytest

from mecheval import cli
from mecheval.models import build_model
from tests.helpers import TINY

pytestmark = pytest.mark.pipeline

ARCH = "examples.retention:DeclaredRetention"


@pytest.mark.parametrize("arch", [ARCH, f"mamba+{ARCH}"], ids=["own", "hybrid"])
def test_train_evaluate_and_report_an_own_mixer(tmp_path, arch):
    run = tmp_path / "runs" / "own"
    steps = ["steps=4", "eval_every=2", "checkpoint_every=2"]
    assert cli.main(["train", "--out", str(run), *TINY, *steps, f"arch={arch}"]) == 0
    assert cli.main(["evaluate", str(run), "--positions", "key", "value", "query"]) == 0
    table = pd.read_parquet(run / "interventions.parquet")
    model = build_model(arch, 40, 16, max_len=13)
    sites = {tuple(name.split(".")[1:]) for name in model.site_names()}
    assert {
        (str(layer), site) for layer, site in zip(table.layer, table.site, strict=True)
    } == sites
    assert set(table.arch) == {arch}
    assert table.p_restored.between(0, 1).all()
    assert cli.main(["report", str(tmp_path / "runs")]) == 0
    report = (tmp_path / "runs" / "report" / "report.md").read_text()
    assert arch in report


def test_a_sweep_of_an_own_mixer_runs_in_worker_processes(tmp_path, monkeypatch):
    """Spawned workers find the mixer by its import path, and a stack of its seeds trains as
    the runs do alone."""
    from mecheval.sweep import expand_sweep, run_sweep

    monkeypatch.chdir(tmp_path)  # `examples` is found from the repository, not from here
    base = {
        "task": {"name": "ar", "options": {"num_pairs": 4, "num_keys": 16}, "train_size": 320},
        "model": {"d_model": 16},
        "steps": 4,
        "eval_every": 2,
        "backend": "torch",
    }
    runs = expand_sweep({"base": base, "grid": {"arch": [ARCH], "seed": [1, 2]}})
    pooled = run_sweep(runs, tmp_path / "pooled", workers=2, progress=False)
    stacked = run_sweep(runs, tmp_path / "stacked", stack=True, progress=False)
    assert (pooled["status"] == "finished").all() and (stacked["status"] == "finished").all()
    assert sorted(pooled["model.arch"]) == [ARCH, ARCH]
    columns = ["run", "dev_accuracy", "test_accuracy"]
    pd.testing.assert_frame_equal(
        pooled[columns].sort_values("run").reset_index(drop=True),
        stacked[columns].sort_values("run").reset_index(drop=True),
        atol=1e-6,
    )
