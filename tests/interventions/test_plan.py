"""The grid's plan (plan_grid) says what interchange_grid runs: which cells, from where, in how
many patched forwards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mecheval.interventions import grid as grid_module
from mecheval.interventions import interchange_grid, plan_grid
from mecheval.interventions.plan import AFTER_MIXER
from mecheval.models import build_model
from mecheval.tasks import make_task

TASK = make_task("ar", num_pairs=4, num_keys=16)


def _setup(arch):
    torch.manual_seed(0)
    model = build_model(arch, TASK.vocab_size, d_model=16, max_len=TASK.max_document_length)
    batch = TASK.sample(5, seed=0, split="dev")
    return model.eval(), batch, TASK.corrupt(batch, at="key", seed=0)


@pytest.mark.parametrize("arch", ["attention", "hyena", "based"])
@pytest.mark.parametrize("positions", [None, ["all"]], ids=["named", "all"])
def test_the_plan_counts_the_forwards_the_grid_runs(arch, positions, monkeypatch):
    model, batch, corrupted = _setup(arch)
    budget = 1 << 22  # small: several chunks
    plan = plan_grid(model, batch, positions=positions, corrupted=corrupted, memory_budget=budget)
    summary = plan.summary()
    assert list(summary["site"]) == [s.ref.short for s in plan.sites]
    assert (summary["run"] <= summary["cells"]).all()
    calls = []
    real = grid_module.logits_at
    monkeypatch.setattr(
        grid_module, "logits_at", lambda *a, **k: calls.append(a[1]) or real(*a, **k)
    )
    interchange_grid(model, batch, corrupted, positions=positions, memory_budget=budget)
    assert len(calls) == 2 + summary["forwards"].sum()  # + the clean and corrupted runs


def test_cells_the_plan_skips_keep_the_corrupted_result():
    model, batch, corrupted = _setup("mamba")
    plan = plan_grid(model, batch, positions=["all"], corrupted=corrupted)
    table = interchange_grid(model, batch, corrupted, positions=["all"])
    for site in plan.sites:
        rows = table[(table["layer"] == site.ref.layer) & (table["site"] == site.ref.short)]
        skipped = np.ones(len(rows), dtype=bool)
        skipped[site.live.numpy()] = False
        part = rows.iloc[np.flatnonzero(skipped)]
        np.testing.assert_array_equal(part["p_restored"], part["p_corrupted"])


def test_resuming_runs_fewer_positions():
    model, batch, _ = _setup("mamba")
    plan = plan_grid(model, batch, positions=["all"])
    summary = plan.summary()
    assert plan.points, "a resumable model gets resume points"
    assert (summary["positions_run"] < summary["run"] * plan.needed).any()


def test_cells_before_the_corruption_are_not_run():
    """The documents agree before the corrupted key: those cells are identities, left out of
    the plan given the corrupted documents, and their results equal the corrupted run's."""
    model, batch, corrupted = _setup("deltanet")
    without = plan_grid(model, batch, positions=["all"]).summary()
    plan = plan_grid(model, batch, positions=["all"], corrupted=corrupted)
    first = (batch.tokens != corrupted).int().argmax(1)
    assert (first > 0).all()
    for site, before in zip(plan.sites, without["run"], strict=True):
        assert (plan.positions[site.live] >= first[plan.example[site.live]]).all()
        # Only the query's cells run after the last mixer: none of them lies before the key.
        after_last_mixer = site.ref.layer == 1 and site.ref.short in AFTER_MIXER
        assert len(site.live) < before or after_last_mixer
