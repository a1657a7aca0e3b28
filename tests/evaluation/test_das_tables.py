"""The report's DAS section never pools what differs (mecheval.evaluation.das_tables): runs are
pooled only within the configuration the rest of the report selected (the best learning rate,
every seed of it) and within one set of DAS settings; every k left out is named; a plot of DAS
tables no longer there is removed."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd

from mecheval import cli
from mecheval.evaluation.das_tables import das_results, iia_table, k_star_table
from mecheval.evaluation.results import best_runs
from mecheval.run_folder.files import DAS, DAS_BASES, DAS_STAMP, write_stamped
from tests.helpers import TINY

SETTINGS = dict(steps=200, lr=0.01, batch_size=64, holdout=0.5, seed=0, split="dev")


def _run(root, name: str, lr: float, seed: int, correct_at_4: float, dims=(4,), **settings):
    """A finished run's row (as collect_results gives it) with a DAS table of 100 held-out
    documents at layer 1's input at the value: no swap never right, the full swap (k = 8)
    always, k = 4 right in a share `correct_at_4` of them."""
    path = root / name
    path.mkdir(parents=True)
    rows = []
    for k, share in ((0, 0.0), *((k, correct_at_4) for k in dims), (8, 1.0)):
        correct = np.arange(100) < round(share * 100)
        rows.append(pd.DataFrame({"example": np.arange(100), "k": k, "correct": correct}))
    table = pd.concat(rows).assign(
        run=name, corruption="key", layer=1, site="block_input", position="value", width=8,
        position_index=3, p_target=0.5, arch="attention", d_model=8, n_layers=2, lr=lr,
        task="ar()", step=10,
    )  # fmt: skip
    stamp = {"settings": {**SETTINGS, "dims": list(dims), **settings}, "left_out": {}}
    write_stamped(path, DAS_STAMP, {DAS: table, DAS_BASES: {}}, stamp)
    return {
        "run": name, "path": str(path), "task": "ar", "setting": "ar(), 10 steps",
        "task_label": "{}", "arch": "attention", "d_model": 8, "n_layers": 2, "lr": lr,
        "seed": seed, "dev_accuracy": 0.9 if lr == 1e-3 else 0.5, "steps": 10,
    }  # fmt: skip


def test_runs_of_another_learning_rate_are_not_pooled_and_are_named(tmp_path):
    """Before: IIA 0.094, the mean of 0.000 (the best learning rate) and 0.188 (another), where
    the rest of the report keeps the best learning rate alone."""
    results = pd.DataFrame(
        [
            _run(tmp_path, "best", 1e-3, 0, correct_at_4=0.0),
            _run(tmp_path, "other", 1e-2, 0, correct_at_4=0.19),
        ]
    )
    best = best_runs(results)
    das, notes = das_results(results, best)
    assert set(das["run"]) == {"best"}
    iia = iia_table(das).set_index("k")["iia"]
    assert iia[4] == 0.0 and iia[8] == 1.0
    assert any("1 run(s) of other learning rates" in note and "other" in note for note in notes)


def test_seeds_pool_within_one_set_of_das_settings(tmp_path):
    results = pd.DataFrame(
        [
            _run(tmp_path, "s0", 1e-3, 0, correct_at_4=0.2),
            _run(tmp_path, "s1", 1e-3, 1, correct_at_4=0.4),
            _run(tmp_path, "s2", 1e-3, 2, correct_at_4=0.9, steps=20),
        ]
    )
    das, _ = das_results(results, best_runs(results))
    table = k_star_table(das)
    assert len(table) == 2  # the 200-step DAS of two seeds, and the 20-step one alone
    pooled = table[table["das_settings"].str.startswith("steps 200")].iloc[0]
    alone = table[table["das_settings"].str.startswith("steps 20,")].iloc[0]
    assert pooled["runs"] == 2 and alone["runs"] == 1
    iia = iia_table(das)
    at4 = iia[(iia["k"] == 4) & iia["das_settings"].str.startswith("steps 200")]["iia"]
    assert at4.item() == 0.3  # (0.2 + 0.4) / 2 over the two seeds' documents


def test_every_k_left_out_is_named(tmp_path):
    results = pd.DataFrame([_run(tmp_path, "s0", 1e-3, 0, correct_at_4=0.5, dims=(2, 4))])
    das, _ = das_results(results, best_runs(results))
    das = das[~((das["k"] == 2) & (das["example"] < 10))]  # ten documents lack k = 2
    table = k_star_table(das)
    assert table["k_left_out"].item() == "2"
    # And sizes a DAS left out at a site narrower than them (das.json's `left_out`).
    row = _run(tmp_path / "n", "narrow", 1e-3, 0, correct_at_4=0.5)
    stamp_path = tmp_path / "n" / "narrow" / DAS_STAMP
    stamp = json.loads(stamp_path.read_text())
    stamp["left_out"] = {"layers.1.block_input": [16, 32]}
    stamp_path.write_text(json.dumps(stamp))
    _, notes = das_results(pd.DataFrame([row]), best_runs(pd.DataFrame([row])))
    assert "k 16, 32 left out attention at layers.1.block_input (wider than it)." in notes


def test_a_stale_das_plot_is_removed_with_its_tables(tmp_path):
    run = tmp_path / "runs" / "one"
    argv = ["train", "--out", str(run), *TINY, "steps=2", "eval_every=2"]
    assert cli.main(argv) == 0
    das = ["das", str(run), "--sites", "block_input", "--layers", "1", "--dims", "2"]
    assert cli.main([*das, "--positions", "value", "--steps", "1"]) == 0
    assert cli.main(["report", str(tmp_path / "runs")]) == 0
    plot = tmp_path / "runs" / "report" / "das_iia.png"
    assert plot.exists()
    for name in (DAS, DAS_BASES, DAS_STAMP):
        (run / name).unlink()
    assert cli.main(["report", str(tmp_path / "runs")]) == 0
    assert not plot.exists()
    assert "![das_iia.png]" not in (tmp_path / "runs" / "report" / "report.md").read_text()
