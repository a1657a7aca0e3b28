"""The batched interchange grid against the plain per-cell hook loop, cell by cell."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from mecheval.interventions import attrib, interchange_grid, per_cell_loop, readout
from mecheval.models import ARCHITECTURES, build_model
from mecheval.tasks import make_task

TASK = make_task("ar", num_pairs=4, num_keys=16)
ARCHS = list(ARCHITECTURES)  # every mixer, each resuming near its patched position


def _model(arch: str, seed: int = 0, trained_scale: float = 1.0):
    torch.manual_seed(seed)
    model = build_model(
        arch, vocab_size=TASK.vocab_size, d_model=16, max_len=TASK.max_document_length
    )
    if trained_scale != 1.0:  # sharper, more "trained-like" weights than the small init
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(trained_scale)
    return model.eval()


def _data(n: int = 6, seed: int = 0):
    batch = TASK.sample(n, seed=seed, split="dev")
    return batch, TASK.corrupt(batch, "key", seed=seed)


def _merge(fast: pd.DataFrame, slow: pd.DataFrame) -> pd.DataFrame:
    keys = ["example", "layer", "site", "position"]
    assert len(fast) == len(slow)
    merged = fast.merge(slow, on=keys, suffixes=("", "_loop"), validate="one_to_one")
    assert len(merged) == len(fast)
    return merged


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("scale", [1.0, 8.0], ids=["init", "sharp"])
def test_every_cell_matches_the_per_cell_loop(arch, scale):
    model = _model(arch, trained_scale=scale)
    batch, corrupted = _data()
    fast = interchange_grid(model, batch, corrupted)
    slow = per_cell_loop(model, batch, corrupted)
    merged = _merge(fast, slow)
    assert set(fast["site"]) == {name.split(".", 2)[2] for name in model.site_names()}
    for column in ("p_original", "p_corrupted", "p_restored", "logit_restored", "kl"):
        # float32 rounding scales with the values: logits of a sharpened model reach ~10
        atol = 1e-5 * max(1.0, float(np.abs(merged[f"{column}_loop"]).max()))
        np.testing.assert_allclose(
            merged[column], merged[f"{column}_loop"], atol=atol, rtol=1e-4, err_msg=column
        )
    assert (merged["position_index"] == merged["position_index_loop"]).all()


def test_all_positions_and_shifted_names():
    model = _model("mamba")
    batch, corrupted = _data(n=3)
    positions = ["all", "value+1", "value+2"]
    fast = interchange_grid(
        model, batch, corrupted, sites=["conv_output", "state", "block_input"], positions=positions
    )
    slow = per_cell_loop(
        model, batch, corrupted, sites=["conv_output", "state", "block_input"], positions=positions
    )
    merged = _merge(fast, slow)
    np.testing.assert_allclose(
        merged["p_restored"], merged["p_restored_loop"], atol=1e-5, rtol=1e-4
    )
    length = batch.tokens.shape[1]
    assert set(fast["position"]) == {str(i) for i in range(length)} | {"value+1", "value+2"}
    shifted = fast[fast["position"] == "value+1"]
    expected = (batch.positions["value"] + 1).numpy()[shifted["example"].to_numpy()]
    assert (shifted["position_index"].to_numpy() == expected).all()


def test_chunking_changes_nothing():
    model = _model("deltanet", trained_scale=4.0)
    batch, corrupted = _data()
    whole = interchange_grid(model, batch, corrupted)
    chunked = interchange_grid(model, batch, corrupted, memory_budget=1)  # one row at a time
    pd.testing.assert_frame_equal(whole, chunked, atol=1e-6, rtol=1e-5)


def test_patching_with_the_corrupted_run_itself_restores_nothing():
    """Clean == corrupted: every patch is a no-op, so p_restored == p_corrupted everywhere."""
    model = _model("attention", trained_scale=8.0)
    batch, corrupted = _data()
    same = type(batch)(corrupted, batch.answers, batch.positions, batch.lengths)
    df = interchange_grid(model, same, corrupted)
    np.testing.assert_allclose(df["p_restored"], df["p_corrupted"], atol=1e-6)
    np.testing.assert_allclose(df["kl"], 0.0, atol=1e-5)


def test_restoring_the_whole_residual_restores_the_clean_run():
    """Patching block_input of layer 0 at the corrupted key position (the only differing
    token) gives back the clean run exactly."""
    model = _model("attention", trained_scale=8.0)
    batch, corrupted = _data()
    df = interchange_grid(
        model, batch, corrupted, layers=[0], sites=["block_input"], positions=["key"]
    )
    np.testing.assert_allclose(df["p_restored"], df["p_original"], atol=1e-6)
    np.testing.assert_allclose(df["kl"], 0.0, atol=1e-5)


def test_attrib_formula_and_dropping():
    df = pd.DataFrame(
        {
            "run": ["a"] * 4 + ["b"] * 2,
            "example": [0, 1, 0, 1, 0, 1],
            "layer": [1, 1, 1, 1, 1, 1],
            "site": ["block_input"] * 6,
            "position": ["value", "value", "query", "query", "value", "value"],
            "position_index": [2, 2, 9, 9, 2, 2],
            "p_original": [0.9, 0.7, 0.9, 0.7, 0.5, 0.5],
            "p_corrupted": [0.1, 0.1, 0.1, 0.1, 0.495, 0.5],
            "p_restored": [0.8, 0.6, 0.1, 0.2, 0.5, 0.5],
            "logit_restored": 0.0,
            "kl": 0.0,
        }
    )
    table = attrib(df)
    assert list(table["run"]) == ["a", "a"]  # run b's corruption effect (0.0025) is dropped
    value = table[table["position"] == "value"].iloc[0]
    assert value["attrib"] == pytest.approx((0.7 - 0.1) / (0.8 - 0.1))
    query = table[table["position"] == "query"].iloc[0]
    assert query["attrib"] == pytest.approx((0.15 - 0.1) / (0.8 - 0.1))
    out = readout(df)
    assert list(out["mechanism"]) == ["induction", "no effect"]


def test_bad_arguments_are_refused_by_name():
    model = _model("attention")
    batch, corrupted = _data()
    with pytest.raises(ValueError, match="shape"):
        interchange_grid(model, batch, corrupted[:, :-1])
    with pytest.raises(ValueError, match="unknown site"):
        interchange_grid(model, batch, corrupted, sites=["state"])
    with pytest.raises(ValueError, match="out of range"):
        interchange_grid(model, batch, corrupted, layers=[5])
    with pytest.raises(ValueError, match="'middle' is not a role of these documents"):
        interchange_grid(model, batch, corrupted, positions=["middle"])
    with pytest.raises(ValueError, match="outside"):
        interchange_grid(model, batch, corrupted, positions=["query+5"])
