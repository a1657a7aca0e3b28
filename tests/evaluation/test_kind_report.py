"""Path patching's route shares pooled over a configuration's seeds (routes_over_seeds) on
path tables written out by hand: the pooled share is the ratio of means over every seed's
documents, each seed's own share is listed in seed order, a sender the corruption leaves
unchanged gives no row, and the interval holds the share."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mecheval.evaluation import kind_report

ROUTES = ("conv", "state")


def _path_table(run: str, conv_share: float, rng: np.random.Generator, docs: int = 40):
    """Layer 0, sender at the key: the conv carries `conv_share` of the effect, the state the
    rest; under the value corruption the sender (before the value) is unchanged."""
    rows = []
    for corruption in ("key", "value"):
        for example in range(docs):
            original, corrupted = 0.9 + 0.1 * rng.random(), 0.1 * rng.random()
            moved = corruption == "key"
            for route, share in zip(ROUTES, (conv_share, 1 - conv_share), strict=True):
                rows.append(
                    {"run": run, "corruption": corruption, "receiver": "logits", "layer": 0,
                     "position": "key", "route": route, "example": example,
                     "p_original": original, "p_corrupted": corrupted,
                     "p_restored": corrupted + share * (original - corrupted) * moved,
                     "kl": 0.0, "p_sender": original if moved else corrupted}
                )  # fmt: skip
    return pd.DataFrame(rows)


@pytest.fixture
def runs(monkeypatch):
    rng = np.random.default_rng(0)
    shares = {"m-s44": (44, 0.7), "m-s42": (42, 0.9), "m-s43": (43, 0.8), "a-s42": (42, 1.0)}
    tables = {run: _path_table(run, share, rng) for run, (_, share) in shares.items()}
    monkeypatch.setattr(kind_report, "evaluated_kinds", lambda folder: {"path.parquet": "path"})
    monkeypatch.setattr(kind_report.files, "read_table", lambda folder, name: tables[folder])
    return pd.DataFrame(
        {"run": list(shares), "path": list(shares), "seed": [s for s, _ in shares.values()],
         "setting": "ar", "task_label": "ar", "steps": 10, "d_model": 64, "n_layers": 2,
         "arch": ["mamba", "mamba", "mamba", "attention"], "lr": 1e-3}
    )  # fmt: skip


def test_route_shares_pool_the_seeds_of_a_configuration(runs):
    table = kind_report.routes_over_seeds(runs, reps=200)
    assert set(table["corruption"]) == {"key"}  # the value's corruption leaves the key as it was
    mamba = table[table["arch"] == "mamba"].set_index("route")
    assert mamba.loc["conv", "per_seed"] == "0.90 / 0.80 / 0.70"  # seeds 42, 43, 44
    assert mamba.loc["conv", "seeds"] == 3
    assert mamba.loc["conv", "value"] == pytest.approx(0.8, abs=0.02)
    assert mamba.loc["state", "value"] == pytest.approx(0.2, abs=0.02)
    for route in ROUTES:
        row = mamba.loc[route]
        assert row["low"] <= row["value"] <= row["high"]
    attention = table[table["arch"] == "attention"].set_index("route")
    assert attention.loc["conv", "seeds"] == 1 and attention.loc["conv", "per_seed"] == "1.00"


def test_no_path_table_gives_an_empty_table_with_its_columns(runs, monkeypatch):
    monkeypatch.setattr(kind_report, "evaluated_kinds", lambda folder: {})
    table = kind_report.routes_over_seeds(runs)
    assert table.empty and {"route", "value", "low", "high", "per_seed"} <= set(table.columns)
