"""Architectures by name (mecheval.models.registry): registering a mixer, naming one by import
path, hybrids by layer; each builds, trains and is evaluated as the zoo's are."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from examples.retention import ResumableRetention
from mecheval.interventions import interchange_grid, per_cell_loop
from mecheval.layers import CausalSelfAttention, Mamba
from mecheval.models import (
    ARCHITECTURES,
    MambaBlock,
    TransformerBlock,
    architecture,
    build_model,
    register_mixer,
)
from mecheval.models.registry import unregister_mixer
from mecheval.tasks import make_task

TASK = make_task("ar", num_pairs=4, num_keys=16)


@pytest.fixture
def registered():
    names = []

    def register(name, factory, **kwargs):
        names.append(name)
        return register_mixer(name, factory, **kwargs)

    yield register
    for name in names:
        unregister_mixer(name)


def test_the_zoo_is_registered_by_name():
    assert ARCHITECTURES[:7] == (
        "attention",
        "base_conv",
        "base_conv_long",
        "based",
        "based_long",
        "h3",
        "hyena",
    )
    assert architecture("mamba").parts[0].block == "mamba"
    assert architecture("attention").position_embeddings(1)


def test_a_registered_mixer_takes_its_factorys_options(registered):
    registered("retention_test", ResumableRetention)
    model = build_model("retention_test", 20, 16, max_len=8, num_heads=4)
    assert all(type(b.mixer) is ResumableRetention for b in model.layers)
    assert model.layers[0].mixer.num_heads == 4
    assert model.config.resolved() == {"position_embeddings": False, "num_heads": 4}
    with pytest.raises(ValueError, match="option.* heads do not apply.*its options: num_heads"):
        build_model("retention_test", 20, 16, max_len=8, heads=4)
    with pytest.raises(ValueError, match="divisible by num_heads 3"):
        build_model("retention_test", 20, 16, max_len=8, num_heads=3)
    with pytest.raises(ValueError, match="already registered"):
        register_mixer("retention_test", ResumableRetention)


def test_factories_get_the_layer_index_and_sizes_they_ask_for(registered):
    seen = []

    def factory(d_model, layer_idx, l_max, width=2):
        seen.append((d_model, layer_idx, l_max, width))
        return ResumableRetention(d_model) if layer_idx else CausalSelfAttention(d_model)

    registered("layered_test", factory, position_embeddings=True)
    model = build_model("layered_test", 20, 16, n_layers=2, max_len=8, l_max=32, width=3)
    # (the config's check builds the mixers on the meta device first)
    assert seen == [(16, 0, 32, 3), (16, 1, 32, 3)] * 2
    assert [type(b.mixer) for b in model.layers] == [CausalSelfAttention, ResumableRetention]
    assert model.position_embedding is not None


@pytest.mark.parametrize(
    "name, factory, words",
    [
        ("bad name", ResumableRetention, "must be letters"),
        ("a+b", ResumableRetention, "must be letters"),
        ("no_d_model", lambda: None, "must take d_model"),
        ("needs_option", lambda d_model, width: None, "takes 'width' without a default"),
    ],
)
def test_bad_registrations_are_refused_by_name(name, factory, words):
    with pytest.raises((ValueError, TypeError), match=words):
        register_mixer(name, factory)


def test_a_mixer_named_by_import_path():
    model = build_model("examples.retention:ResumableRetention", 20, 16, max_len=8, num_heads=2)
    assert type(model.layers[1].mixer) is ResumableRetention
    assert model.config.arch == "examples.retention:ResumableRetention"
    with pytest.raises(ValueError, match="cannot import 'examples.nosuch'"):
        build_model("examples.nosuch:Mixer", 20, 16, max_len=8)
    with pytest.raises(ValueError, match="has no 'Nothing'"):
        build_model("examples.retention:Nothing", 20, 16, max_len=8)
    with pytest.raises(ValueError, match="unknown arch 'transformer'.*register_mixer"):
        build_model("transformer", 20, 16, max_len=8)


def test_a_hybrid_stacks_its_parts_by_layer_with_their_blocks_and_inits():
    torch.manual_seed(0)
    model = build_model("mamba+attention", 20, 16, n_layers=4, max_len=8)
    assert [type(b) for b in model.layers] == [MambaBlock, TransformerBlock] * 2
    assert [type(b.mixer) for b in model.layers] == [Mamba, CausalSelfAttention] * 2
    assert model.position_embedding is not None  # attention's default
    # Each block has its own scheme: attention's Linear weights ~ N(0, 0.02), Mamba's in_proj
    # keeps PyTorch's uniform init (bound 1 / sqrt(16) = 0.25).
    assert model.layers[1].mixer.Wqkv.weight.std() < 0.03
    in_proj = model.layers[0].mixer.in_proj.weight
    assert 0.1 < in_proj.std() < 0.2 and in_proj.abs().max() <= 0.25
    # Options go to the parts that take them.
    mixed = build_model("mamba+attention", 20, 16, max_len=8, d_state=4, num_heads=2)
    assert mixed.layers[0].mixer.d_state == 4 and mixed.layers[1].mixer.num_heads == 2


def test_the_grid_of_a_hybrid_equals_the_per_cell_loop():
    torch.manual_seed(0)
    model = build_model(
        "mamba+examples.retention:ResumableRetention",
        TASK.vocab_size,
        16,
        max_len=TASK.max_document_length,
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)
    batch = TASK.sample(5, seed=1, split="dev")
    corrupted = TASK.corrupt(batch, "key", seed=1)
    fast = interchange_grid(model, batch, corrupted)
    slow = per_cell_loop(model, batch, corrupted)
    merged = fast.merge(slow, on=["example", "layer", "site", "position"], suffixes=("", "_loop"))
    assert len(merged) == len(fast) == len(slow)
    for column in ("p_restored", "kl"):
        np.testing.assert_allclose(merged[column], merged[f"{column}_loop"], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "arch, n_layers, parts",
    [("mamba+attention+deltanet", 2, 3), ("mamba+attention", 1, 2), ("mamba+attention", 3, 2)],
)
def test_a_hybrid_whose_parts_do_not_divide_the_layers_is_refused_naming_both(
    arch, n_layers, parts
):
    """Before: 3 parts on 2 layers dropped DeltaNet silently; 2 parts on 1 layer dropped
    attention but kept its position embeddings."""
    words = f"arch '{arch}' has {parts} parts, which do not divide its {n_layers} layer"
    with pytest.raises(ValueError, match=re.escape(words)):
        build_model(arch, 20, 16, n_layers=n_layers, max_len=8)
    model = build_model(arch, 20, 16, n_layers=parts, max_len=8)  # one part per layer
    assert len({type(b.mixer) for b in model.layers}) == parts


def test_position_embeddings_come_from_the_parts_of_the_layers_alone():
    hybrid = architecture("mamba+attention")
    assert not hybrid.position_embeddings(1)  # layer 0 is Mamba's
    assert hybrid.position_embeddings(2)
    assert build_model("mamba+attention", 20, 16, max_len=8).position_embedding is not None
    assert build_model("mamba+deltanet", 20, 16, max_len=8).position_embedding is None


def test_a_hybrid_takes_options_per_part():
    model = build_model(
        "mamba+mamba_noconv",
        20,
        16,
        max_len=8,
        expand=1,
        mamba={"d_state": 4, "d_conv": 2},
        mamba_noconv={"d_state": 8},
    )
    first, second = (b.mixer for b in model.layers)
    assert (first.d_state, first.d_conv, first.expand) == (4, 2, 1)
    assert (second.d_state, second.use_conv, second.expand) == (8, False, 1)
    # A part's own options win over the shared ones.
    model = build_model("mamba+attention", 20, 16, max_len=8, d_state=4, mamba={"d_state": 2})
    assert model.layers[0].mixer.d_state == 2
    with pytest.raises(ValueError, match="option.* num_heads do not apply to part 'mamba'"):
        build_model("mamba+attention", 20, 16, max_len=8, mamba={"num_heads": 2})
    with pytest.raises(ValueError, match="option.* nope do not apply to arch"):
        build_model("mamba+attention", 20, 16, max_len=8, nope={"num_heads": 2})
