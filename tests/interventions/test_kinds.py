"""Intervention kinds as a contract: the shipped kinds by name, a kind of one's own by import
path, options checked by name, summaries that agree with the tables they summarise."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mecheval.interventions import (
    Intervention,
    interchange_grid,
    intervention_class,
    make_intervention,
    register_intervention,
    registered_interventions,
    route_shares,
)
from mecheval.models import build_model
from mecheval.tasks import make_task

TASK = make_task("ar", num_pairs=4, num_keys=16)


def _run(kind, arch="mamba"):
    torch.manual_seed(0)
    model = build_model(arch, TASK.vocab_size, 16, max_len=TASK.max_document_length).eval()
    batch = TASK.sample(6, seed=0, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=0) if kind.corrupts else None
    return model, batch, corrupted, kind.run(model, batch, corrupted)


def test_the_shipped_kinds_are_registered():
    assert registered_interventions()[:6] == (
        "grid", "mean_ablation", "resample_ablation", "path", "eap", "eap_ig"
    )  # fmt: skip


def test_the_grid_kind_is_the_interchange_grid_and_summarises_as_attrib():
    kind = make_intervention("grid", positions=("key", "query"))
    model, batch, corrupted, table = _run(kind)
    direct = interchange_grid(model, batch, corrupted, positions=["key", "query"])
    assert table.equals(direct)
    summary = kind.summary(table)
    assert {"value", "low", "high"} <= set(summary.columns)


def test_route_shares_are_the_attrib_formula_over_routes():
    kind = make_intervention("path", layers=(0,))
    *_, table = _run(kind)
    shares = route_shares(table)
    for route, part in table.groupby("route"):
        mean = part[["p_original", "p_corrupted", "p_restored"]].mean()
        expected = (mean.p_restored - mean.p_corrupted) / (mean.p_original - mean.p_corrupted)
        got = shares[shares.route == route].value
        if mean.p_original - mean.p_corrupted > 0.01:
            np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_a_kind_of_ones_own_by_import_path():
    kind = make_intervention("examples.zero_ablation:ZeroAblation", positions=("key",))
    *_, table = _run(kind)
    assert set(table.position) == {"key"} and table.p_restored.between(0, 1).all()
    assert intervention_class("examples.zero_ablation:ZeroAblation").name == "zero_ablation"


def test_what_is_not_a_kind_and_unknown_options_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown intervention kind 'nope'"):
        make_intervention("nope")
    with pytest.raises(TypeError, match="unknown option\\(s\\) \\['routes'\\] for intervention"):
        make_intervention("grid", routes=["conv"])
    with pytest.raises(TypeError, match="must be a subclass of Intervention"):
        register_intervention("bad", dict)

    @dataclasses.dataclass(frozen=True)
    class NoRun(Intervention):
        name = "norun"

    with pytest.raises(TypeError, match="writes run"):
        register_intervention("norun", NoRun)
