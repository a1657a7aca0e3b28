"""ModelConfig and build_model: the study's defaults, round trips, refused configurations."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mecheval.layers import H3, BaseConv, BasedLinearAttention, Mamba, Mamba2
from mecheval.models import (
    ARCHITECTURES,
    LanguageModel,
    ModelConfig,
    build_model,
    model_config,
)
from mecheval.models.blocks import MambaBlock, TransformerBlock


def test_architectures_cover_the_study():
    assert set(ARCHITECTURES) >= {
        "attention",
        "base_conv",
        "based",
        "h3",
        "hyena",
        "mamba",
        "mamba_noconv",
        "deltanet",
        "deltanet_noconv",
    }


def test_position_embeddings_default_to_attention_only():
    for arch in ARCHITECTURES:
        model = build_model(arch, 50, 16, max_len=8)
        assert (model.position_embedding is not None) == (arch == "attention"), arch
    assert (
        build_model("attention", 50, 16, max_len=8, position_embeddings=False).position_embedding
        is None
    )
    assert (
        build_model("mamba", 50, 16, max_len=8, position_embeddings=True).position_embedding
        is not None
    )


def test_spec_defaults():
    mamba = build_model("mamba", 50, 16, max_len=8)
    assert all(isinstance(b, MambaBlock) for b in mamba.layers)
    m = mamba.layers[0].mixer
    assert isinstance(m, Mamba) and (m.d_state, m.d_conv, m.expand) == (16, 4, 2)
    assert not hasattr(build_model("mamba_noconv", 50, 16, max_len=8).layers[0].mixer, "conv1d")
    mamba2 = build_model("mamba2", 50, 64, max_len=8)
    assert all(isinstance(b, MambaBlock) for b in mamba2.layers)
    m2 = mamba2.layers[0].mixer
    assert isinstance(m2, Mamba2)
    assert (m2.d_state, m2.d_conv, m2.expand, m2.headdim, m2.nheads, m2.ngroups) == (
        64,
        4,
        2,
        16,
        8,
        1,
    )
    assert not hasattr(build_model("mamba2_noconv", 50, 16, max_len=8).layers[0].mixer, "conv1d")
    assert build_model("mamba", 50, 16, max_len=8, d_conv=2).layers[1].mixer.conv1d.kernel_size == (
        2,
    )
    h3 = build_model("h3", 50, 16, max_len=37).layers[0].mixer
    assert isinstance(h3, H3) and (h3.d_state, h3.head_dim) == (1024, 2)
    assert build_model("h3", 50, 16, max_len=37, l_max=64).layers[0].mixer.d_state == 64
    assert build_model("hyena", 50, 16, max_len=8).layers[0].mixer.filter_fn.z.shape == (1024, 3)
    bc = build_model("base_conv", 50, 16, n_layers=3, max_len=8)
    kinds = [b.mixer.is_long for b in bc.layers]
    assert kinds == [False, True, False] and bc.layers[0].mixer.kernel_size == 3
    based = build_model("based", 50, 16, max_len=8)
    assert isinstance(based.layers[0].mixer, BaseConv) and not based.layers[0].mixer.is_long
    assert isinstance(based.layers[1].mixer, BasedLinearAttention)
    assert based.layers[1].mixer.feature_dim == 8 and based.layers[1].mixer.num_heads == 1
    long_only = build_model("base_conv_long", 50, 16, n_layers=3, max_len=8)
    assert [b.mixer.is_long for b in long_only.layers] == [True, True, True]
    assert long_only.layers[0].mixer.conv.z.shape == (1024, 3)
    based_long = build_model("based_long", 50, 16, n_layers=3, max_len=8)
    assert [type(b.mixer) for b in based_long.layers] == [
        BaseConv,
        BasedLinearAttention,
        BaseConv,
    ]
    assert based_long.layers[0].mixer.is_long and based_long.layers[2].mixer.is_long
    hyena = build_model("hyena", 50, 16, max_len=8).layers[0].mixer
    assert hyena.filter_fn.order == 64 and hyena.short_filter.kernel_size == (3,)
    assert all(
        isinstance(b, TransformerBlock) for b in build_model("deltanet", 50, 16, max_len=8).layers
    )
    dn = build_model("deltanet", 50, 16, max_len=8).layers[0].mixer
    assert dn.num_heads == 1 and dn.conv_size == 4 and dn.use_short_conv and dn.qk_norm == "l2"
    assert not build_model("deltanet_noconv", 50, 16, max_len=8).layers[0].mixer.use_short_conv


def test_config_round_trips_through_a_plain_dict():
    config = ModelConfig("mamba", 8195, 64, max_len=37, options={"d_conv": 2})
    plain = dataclasses.asdict(config)
    scalars = (str, int, float, bool, type(None))
    assert all(isinstance(v, scalars) for k, v in plain.items() if k != "options")
    assert plain["options"] == {"d_conv": 2}
    assert ModelConfig(**plain) == config
    a, b = LanguageModel(config), LanguageModel(ModelConfig(**plain))
    assert set(a.state_dict()) == set(b.state_dict())
    assert config.resolved() == {
        "position_embeddings": False,
        "d_state": 16,
        "d_conv": 2,
        "expand": 2,
    }


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(arch="transformer"), "unknown arch 'transformer'"),
        (dict(d_model=0), "d_model must be >= 1"),
        (dict(vocab_size=-3), "vocab_size"),
        (dict(n_layers=0), "n_layers"),
        (dict(max_len=0), "max_len"),
        (dict(d_model=16.0), "d_model must be an int"),
        (dict(n_layers=True), "n_layers must be an int"),
        (dict(arch="attention", d_state=16), "d_state do not apply to arch 'attention'"),
        (dict(arch="mamba_noconv", d_conv=4), "d_conv do not apply"),
        (dict(arch="base_conv_long", d_conv=3), "d_conv do not apply"),
        (dict(arch="based_long", d_conv=3), "d_conv do not apply"),
        (dict(arch="mamba", feature_dim=8, num_heads=2), "feature_dim, num_heads do not apply"),
        (dict(arch="mamba", d_conv=5), "d_conv must be in 1..4"),
        (dict(arch="mamba", d_conv=0), "d_conv must be in 1..4"),
        (dict(arch="deltanet", d_conv=9), "d_conv must be in 1..8"),
        (dict(arch="attention", num_heads=3), "divisible by num_heads 3"),
        (dict(arch="h3", head_dim=3), "divisible by head_dim 3"),
        (dict(arch="h3", d_state=1), "d_state >= 2"),
        (dict(arch="mamba", expand=0), "expand must be >= 1"),
        (dict(arch="mamba2", head_dim=5), "divisible by head_dim 5"),
        (dict(arch="mamba2_noconv", d_conv=4), "d_conv do not apply"),
        (dict(arch="attention", position_embeddings=1), "position_embeddings must be a bool"),
        (dict(arch="mamba", l_max=0), "l_max must be >= 1"),
    ],
)
def test_bad_configurations_are_refused(kwargs, match):
    base = dict(arch="mamba", vocab_size=50, d_model=16, n_layers=2, max_len=8)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        model_config(**base)


def test_build_model_refuses_unknown_options():
    with pytest.raises(ValueError, match="dropout, n_layer do not apply to arch 'attention'"):
        build_model("attention", 50, 16, max_len=8, dropout=0.1, n_layer=2)
    with pytest.raises(TypeError):
        LanguageModel({"arch": "attention"})


def test_model_refuses_bad_inputs():
    import torch

    model = build_model("attention", 50, 16, max_len=8)
    with pytest.raises(ValueError, match="max_len=8"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        model(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="layer_index"):
        model.forward_from(3, torch.zeros(1, 4, 16))
    with pytest.raises(ValueError, match="residual"):
        model.forward_from(0, torch.zeros(1, 4, 15))


def test_init_scheme_option():
    study = build_model("attention", 40, 16, max_len=8)
    torch.manual_seed(0)
    default = build_model("attention", 40, 16, max_len=8, init="pytorch")
    assert study.config.init == "study" and default.config.init == "pytorch"
    # The study's scheme draws embeddings ~ N(0, 0.02); PyTorch's default is N(0, 1).
    assert study.embedding.weight.std() < 0.05 < 0.5 < default.embedding.weight.std()
    with pytest.raises(ValueError, match="unknown init 'xavier'"):
        build_model("attention", 40, 16, max_len=8, init="xavier")


@pytest.mark.parametrize("arch", ["hyena", "base_conv", "base_conv_long", "based_long"])
def test_implicit_filters_refuse_sequences_longer_than_l_max(arch):
    """A model may accept longer documents (max_len) than its filters are laid out for
    (l_max); a sequence past l_max is refused by name when it runs."""
    import torch

    model = build_model(arch, 50, 16, max_len=40, l_max=32)
    assert model(torch.zeros(1, 32, dtype=torch.long)).shape == (1, 32, 50)
    with pytest.raises(ValueError, match="exceeds the filter's l_max=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
