"""Attribution patching (mecheval.interventions.attribution) against the exact interchange
grid and against its first-order formula recomputed with plain autograd."""

from __future__ import annotations

import numpy as np
import torch

from mecheval.interventions import interchange_grid
from tests.interventions.test_grid import _data, _model


def test_attribution_patching_estimates_and_ranks_cells():
    from mecheval.interventions import attribution_patching

    model = _model("attention", trained_scale=4.0)
    batch, corrupted = _data(n=16)
    where = dict(
        sites=["block_input", "mixer_output", "mlp_output"],
        positions=["key", "value", "query", "answer"],
    )
    exact = interchange_grid(model, batch, corrupted, **where)
    estimate = attribution_patching(model, batch, corrupted, **where)
    assert len(estimate) == len(exact)
    merged = exact.merge(
        estimate, on=["example", "layer", "site", "position"], suffixes=("", "_est")
    )
    np.testing.assert_allclose(merged["p_corrupted"], merged["p_corrupted_est"], atol=1e-6)
    # The answer stands after the query: patching it changes nothing, exactly and estimated.
    after = merged[merged["position"] == "answer"]
    assert len(after) > 0
    np.testing.assert_allclose(after["p_restored"], after["p_corrupted"], atol=1e-6)
    np.testing.assert_allclose(after["p_restored_est"], after["p_corrupted"], atol=1e-7)
    # The estimate is (a_clean - a_corrupted) . d p_answer / d a_corrupted: recompute it for
    # layer 1's block input through forward_from and plain autograd.
    import torch.nn.functional as F

    rows = torch.arange(len(batch))
    with torch.no_grad():
        with model.intervene(reads={"layers.1.block_input": None}) as record:
            model(batch.tokens)
        a_clean = record["layers.1.block_input"]
        with model.intervene(reads={"layers.1.block_input": None}) as record:
            model(corrupted)
        a_corrupted = record["layers.1.block_input"].clone().requires_grad_()
    p = F.softmax(model.forward_from(1, a_corrupted, at=batch.positions["query"]), -1)
    p[rows, batch.answers].sum().backward()
    key = batch.positions["key"]
    expected = ((a_clean - a_corrupted.detach()) * a_corrupted.grad)[rows, key].sum(-1)
    cell = merged[
        (merged["layer"] == 1) & (merged["site"] == "block_input") & (merged["position"] == "key")
    ]
    cell = cell.sort_values("example")
    np.testing.assert_allclose(
        cell["p_restored_est"] - cell["p_corrupted"], expected.numpy(), atol=1e-6
    )
