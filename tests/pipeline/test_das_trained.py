"""DAS on a trained model (the pipeline's attention run, which solves its 4-pair AR by
induction): a few dimensions of layer 1's input at the value carry the association, and
training the basis finds them."""

from __future__ import annotations

import pytest

from mecheval.interventions.das import DasSettings, das
from mecheval.train import load_trained_model


def test_training_finds_the_subspace(trained):
    run, _ = trained
    model, task, _ = load_trained_model(run)
    batch = task.sample(128, seed=5, split="dev")
    corrupted = task.corrupt(batch, at="key", seed=5)
    where = dict(sites=["block_input"], layers=[1], positions=["value"], dims=[4])
    found = das(model, batch, corrupted, settings=DasSettings(steps=60, lr=2e-2), **where)
    start = das(model, batch, corrupted, settings=DasSettings(steps=1, lr=1e-9), **where)

    def iia(table, k):
        return table[table["k"] == k]["correct"].mean()

    assert iia(found, 4) > iia(start, 4) + 0.2
    assert iia(found, 64) == pytest.approx(iia(start, 64))  # the full swap has nothing to learn
    assert iia(found, 64) > 0.8  # and the value carries the answer
