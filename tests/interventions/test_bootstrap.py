"""Bootstrap intervals of Attrib: they cover the true value at about their nominal rate
(simulated documents with a known Attrib), shrink with more documents, and widen when the
runs they pool disagree (clustered resampling)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from mecheval.interventions import attrib, attrib_intervals, readout


def simulated_grid(rng, n, truth, run="a", noise=0.15):
    """n documents; at each read-out position p_restored recovers `truth[pos]` of the effect
    on average, with noise."""
    rows = []
    for example in range(n):
        po, pc = rng.uniform(0.5, 1.0), rng.uniform(0.0, 0.2)
        for position, fraction in truth.items():
            pr = pc + fraction * (po - pc) + rng.normal(0, noise)
            rows.append(
                {
                    "run": run,
                    "example": example,
                    "layer": 1,
                    "site": "block_input",
                    "position": position,
                    "position_index": 0,
                    "p_original": po,
                    "p_corrupted": pc,
                    "p_restored": pr,
                    "logit_restored": 0.0,
                    "kl": 0.0,
                }
            )
    return pd.DataFrame(rows)


def test_intervals_cover_the_true_attrib_at_their_nominal_rate():
    rng = np.random.default_rng(0)
    truth = {"value": 0.8}
    covered = 0
    trials = 150
    for t in range(trials):
        grid = simulated_grid(rng, 60, truth).drop(columns=["run"])
        cell = attrib_intervals(grid, reps=400, seed=t).iloc[0]
        assert cell["attrib_low"] <= cell["attrib"] <= cell["attrib_high"]
        covered += cell["attrib_low"] <= truth["value"] <= cell["attrib_high"]
    assert 0.88 <= covered / trials <= 0.99, covered / trials


def test_point_estimate_is_attrib_and_width_shrinks_with_documents():
    rng = np.random.default_rng(1)
    truth = {"value": 0.9, "query": 0.1, "key": 0.0}
    small = simulated_grid(rng, 50, truth).drop(columns=["run"])
    large = simulated_grid(rng, 800, truth).drop(columns=["run"])
    for grid in (small, large):
        with_ci = attrib_intervals(grid, reps=300)
        pd.testing.assert_series_equal(with_ci["attrib"], attrib(grid)["attrib"])
    width = {
        name: (t := attrib_intervals(g, reps=300))["attrib_high"] - t["attrib_low"]
        for name, g in (("small", small), ("large", large))
    }
    # Standard errors fall as 1 / sqrt(n): 16x the documents, about a quarter of the width.
    ratio = (width["large"] / width["small"]).to_numpy()
    assert np.all((ratio > 0.15) & (ratio < 0.4)), ratio


def test_pooling_disagreeing_runs_widens_the_interval():
    rng = np.random.default_rng(2)
    runs = [
        simulated_grid(rng, 200, {"value": v}, run=f"seed{i}", noise=0.05)
        for i, v in enumerate([0.3, 0.9, 0.5, 0.7])
    ]
    grid = pd.concat(runs, ignore_index=True)
    grid["example"] = grid.groupby("run").cumcount()  # examples are per run
    pooled = attrib_intervals(grid, reps=500, cluster="run").iloc[0]
    flat = grid.assign(example=np.arange(len(grid)), run="all")
    within = attrib_intervals(flat.drop(columns=["run"]), reps=500).iloc[0]
    assert pooled["attrib"] == pytest.approx(within["attrib"])
    assert (pooled["attrib_high"] - pooled["attrib_low"]) > 3 * (
        within["attrib_high"] - within["attrib_low"]
    )


def test_readout_reports_intervals_and_refuses_bad_arguments():
    rng = np.random.default_rng(3)
    grid = simulated_grid(rng, 100, {"value": 0.9, "query": 0.05, "key": 0.0})
    row = readout(grid, intervals=True, cluster="run").iloc[0]
    assert row["mechanism"] == "induction"
    assert row["induction_low"] < row["induction"] < row["induction_high"]
    assert row["direct_early_low"] < 0.3
    with pytest.raises(ValueError, match="cluster"):
        attrib_intervals(grid, cluster="seed")
    with pytest.raises(ValueError, match="level"):
        attrib_intervals(grid, level=1.5)
