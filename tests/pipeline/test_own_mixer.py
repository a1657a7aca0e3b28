"""A mixer of one's own, named by import path, through the command line: `mecheval train`,
`evaluate` and `report` work on it unchanged, and a hybrid of it with the zoo's Mamba too."""

from __future__ import annotations

import pandas as pd
import pytest

from mecheval import cli
from mecheval.models import build_model
from tests.reliability.helpers import TINY

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
