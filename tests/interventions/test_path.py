"""Path patching against a plain freeze-and-patch loop (one document, one cell at a time,
forward hooks on the sites, every pass from the embedding), on every route of the zoo's
mixers, a hybrid and the retention example; and what the routes add up to."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mecheval.interventions.path import path_patching, routes_of
from mecheval.interventions.per_cell import path_patching_loop
from mecheval.models import build_model
from mecheval.tasks import make_task

TASK = make_task("ar", num_pairs=4, num_keys=16)


ARCHS = [
    "mamba",
    "mamba2",
    "deltanet",
    "gated_deltanet",
    "attention",
    "based",
    "h3",
    "hyena",
    "mamba_noconv",
    "mamba+attention",
    "examples.retention:DeclaredRetention",
]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_route_equals_the_plain_loop(arch):
    torch.manual_seed(0)
    model = build_model(arch, TASK.vocab_size, 16, max_len=TASK.max_document_length).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    batch = TASK.sample(5, seed=1, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=1)
    table = path_patching(model, batch, corrupted, layer=0, positions=["key"], chunk=3)
    assert set(table.route) == set(routes_of(model, 0))
    for route in routes_of(model, 0):
        ours = table[table.route == route].sort_values("example").p_restored.to_numpy()
        theirs = path_patching_loop(model, batch, corrupted, 0, ["key"], [route]).p_restored
        np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-4)


def test_a_later_receiver_takes_the_routes_value_alone():
    torch.manual_seed(0)
    model = build_model("mamba", TASK.vocab_size, 16, max_len=TASK.max_document_length).eval()
    batch = TASK.sample(4, seed=2, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=2)
    receiver = "layers.1.block_input"
    table = path_patching(model, batch, corrupted, routes=["conv", "state"], receiver=receiver)
    for route in ("conv", "state"):
        ours = table[table.route == route].p_restored.to_numpy()
        loop = path_patching_loop(model, batch, corrupted, 0, ["key"], [route], receiver)
        theirs = loop.p_restored.to_numpy()
        np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=1e-4)


def test_routes_a_mixer_lacks_and_bad_receivers_are_refused_by_name():
    model = build_model("attention", TASK.vocab_size, 16, max_len=TASK.max_document_length)
    batch = TASK.sample(2, seed=0, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=0)
    with pytest.raises(ValueError, match="CausalSelfAttention has no route 'conv'"):
        path_patching(model, batch, corrupted, routes=["conv"])
    with pytest.raises(ValueError, match="receiver must be a site of a layer after 0"):
        path_patching(model, batch, corrupted, receiver="layers.0.mixer_output")
    with pytest.raises(ValueError, match="layer must be in 0..1"):
        path_patching(model, batch, corrupted, layer=2)
