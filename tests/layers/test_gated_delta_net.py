"""Gated DeltaNet (mecheval/layers/gated_delta_net.py) against its published equations
(tests/layers/references.py), loading state dicts shaped like flash-linear-attention's
`GatedDeltaNet` strictly, and initialised as fla initialises it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mecheval.layers import GatedDeltaNet
from tests.layers.references import gated_delta_net_reference
from tests.layers.test_layers import ATOL, RTOL


def fla_gated_delta_net_state_dict(hidden, num_heads, head_dim, expand_v=2, conv_size=4, seed=0):
    """Keys and shapes of fla's `GatedDeltaNet` layer with use_gate, use_short_conv, no conv
    bias and num_v_heads = num_heads: key_dim = num_heads * head_dim, value_dim = num_heads *
    head_dim * expand_v."""
    g = torch.Generator().manual_seed(seed)
    key_dim, value_dim = num_heads * head_dim, num_heads * head_dim * expand_v

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    return {
        "q_proj.weight": rand(key_dim, hidden),
        "k_proj.weight": rand(key_dim, hidden),
        "v_proj.weight": rand(value_dim, hidden),
        "a_proj.weight": rand(num_heads, hidden),
        "b_proj.weight": rand(num_heads, hidden),
        "A_log": torch.rand(num_heads, generator=g).mul(16).log(),
        "dt_bias": rand(num_heads) - 2.0,
        "q_conv1d.weight": rand(key_dim, 1, conv_size),
        "k_conv1d.weight": rand(key_dim, 1, conv_size),
        "v_conv1d.weight": rand(value_dim, 1, conv_size),
        "g_proj.weight": rand(value_dim, hidden),
        "o_norm.weight": 1 + rand(head_dim * expand_v),
        "o_proj.weight": rand(hidden, value_dim),
    }



def test_gated_delta_net_loads_fla_state_dict_and_matches_equations():
    torch.manual_seed(0)
    sd = fla_gated_delta_net_state_dict(16, num_heads=2, head_dim=6, expand_v=2)
    layer = GatedDeltaNet(hidden_size=16, num_heads=2, head_dim=6, expand_v=2)
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == {
        k: tuple(v.shape) for k, v in sd.items()
    }
    layer.load_state_dict(sd, strict=True)
    u = torch.randn(2, 9, 16)
    expected, _ = gated_delta_net_reference(sd, u, num_heads=2)
    torch.testing.assert_close(layer(u).double(), expected, atol=ATOL, rtol=RTOL)


def test_gated_delta_net_without_short_conv_matches_equations():
    torch.manual_seed(0)
    sd = fla_gated_delta_net_state_dict(16, num_heads=1, head_dim=16, expand_v=1, seed=1)
    for n in "qkv":
        del sd[f"{n}_conv1d.weight"]
    layer = GatedDeltaNet(d_model=16, num_heads=1, head_dim=16, expand_v=1, use_short_conv=False)
    layer.load_state_dict(sd, strict=True)
    u = torch.randn(2, 7, 16)
    expected, _ = gated_delta_net_reference(sd, u, num_heads=1, use_short_conv=False)
    torch.testing.assert_close(layer(u).double(), expected, atol=ATOL, rtol=RTOL)


def test_gated_delta_net_initialisation_is_flas():
    torch.manual_seed(0)
    layer = GatedDeltaNet(hidden_size=16, num_heads=8, head_dim=4)
    A = layer.A_log.detach().exp()
    assert (A > 0).all() and (A <= 16).all()
    dt = F.softplus(layer.dt_bias.detach())
    assert dt.min() >= 0.001 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    assert layer.head_v_dim == 8 and layer.value_dim == 64 and layer.key_dim == 32
