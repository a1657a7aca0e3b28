"""DAS batched (mecheval.interventions.das) against das_loop: each (site, position, k) trained
alone through a hook, pyvene's way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mecheval.interventions.das import das
from mecheval.interventions.das_loop import das_loop
from tests.interventions.test_das import KEYS, SETTINGS, _data, _model


@pytest.mark.parametrize(
    "arch, sites",
    [
        ("attention", ["block_input", "mixer_output", "mlp_input", "block_output"]),
        ("mamba", ["conv_output", "state", "mixer_output"]),
        ("deltanet", ["block_input", "state", "mlp_output"]),
    ],
)
def test_the_batched_run_equals_each_combination_alone(arch, sites):
    model = _model(arch)
    batch, corrupted = _data()
    where = dict(sites=sites, positions=["key", "value"], dims=[1, 3])
    fast, bases = das(model, batch, corrupted, settings=SETTINGS, **where)
    slow, alone = das_loop(model, batch, corrupted, settings=SETTINGS, **where)
    assert len(fast) == len(slow) > 0
    # The same bases, learned together and alone: one per (site, position, k < width),
    # orthonormal, and spanning the same subspace (R R^T equal).
    learned = fast[(fast["k"] > 0) & (fast["k"] < fast["width"])]
    combos = learned[["layer", "site", "position", "k", "width"]].drop_duplicates()
    keys = {f"layers.{c.layer}.{c.site}/{c.position}/{c.k}" for c in combos.itertuples()}
    assert set(bases) == set(alone) == keys
    for key, R in bases.items():
        width, k = R.shape
        assert k == int(key.split("/")[-1]) and R.dtype == torch.float32
        torch.testing.assert_close(R.T @ R, torch.eye(k), atol=1e-5, rtol=0)
        torch.testing.assert_close(R @ R.T, alone[key] @ alone[key].T, atol=1e-4, rtol=1e-3)
    merged = fast.merge(slow, on=KEYS, suffixes=("", "_loop"), validate="one_to_one")
    assert len(merged) == len(fast)
    np.testing.assert_allclose(merged["p_target"], merged["p_target_loop"], atol=1e-4, rtol=1e-3)
    assert (merged["correct"] == merged["correct_loop"]).all()
    assert set(fast["k"]) == {0, 1, 3, *fast["width"]}  # no swap and the full swap always there
