"""EAP and EAP-IG over the path cells: integrated gradients over many steps add up to the
exact path patch (completeness), on every route, which checks the gradients through every
carrier (the short convs, the state inside the scan, the sender); one step is only a first
order estimate."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mecheval.interventions.eap import edge_attribution
from mecheval.interventions.path import path_patching
from mecheval.models import build_model
from mecheval.tasks import make_task

TASK = make_task("ar", num_pairs=4, num_keys=16)


def _model(arch):
    torch.manual_seed(0)
    model = build_model(arch, TASK.vocab_size, 16, max_len=TASK.max_document_length).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    return model


@pytest.mark.parametrize("arch", ["mamba", "deltanet", "attention"])
def test_integrated_gradients_add_up_to_the_exact_path_patch(arch):
    model = _model(arch)
    batch = TASK.sample(4, seed=5, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=5)
    exact = path_patching(model, batch, corrupted)
    estimate = edge_attribution(model, batch, corrupted, steps=48)
    keys = ["example", "position", "route"]
    merged = exact.merge(estimate, on=keys, suffixes=("", "_ig"))
    assert len(merged) == len(exact) == len(estimate)
    np.testing.assert_allclose(merged.p_restored_ig, merged.p_restored, atol=5e-4)


def test_one_step_is_the_gradient_at_the_corrupted_run():
    """EAP: as IG's integrand at the corrupted end, so IG's first of two midpoints differs
    from it, and its error against the exact patch is larger than IG's."""
    model = _model("mamba")
    batch = TASK.sample(4, seed=6, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=6)
    exact = path_patching(model, batch, corrupted).p_restored.to_numpy()
    eap = edge_attribution(model, batch, corrupted, steps=1).p_restored.to_numpy()
    ig = edge_attribution(model, batch, corrupted, steps=16).p_restored.to_numpy()
    assert np.abs(ig - exact).max() < np.abs(eap - exact).max()
    assert np.abs(eap - exact).max() > 1e-4  # the patch is not linear in its carriers


def test_bad_steps_are_refused():
    model = _model("mamba")
    batch = TASK.sample(2, seed=0)
    with pytest.raises(ValueError, match="steps must be >= 1"):
        edge_attribution(model, batch, TASK.corrupt(batch, "key", seed=0), steps=0)
