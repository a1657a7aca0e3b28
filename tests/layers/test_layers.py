"""The reusable layers against their published equations (tests/layers/references.py), and
state dicts shaped like mamba-ssm's and flash-linear-attention's loading strictly."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mecheval.layers import DeltaNet, GatedDeltaNet, Mamba, ShortConvolution
from mecheval.layers.long_conv import DIRECT_MAX_LEN, long_causal_conv
from tests.layers.references import (
    causal_depthwise_conv,
    delta_net_reference,
    mamba_reference,
)

# float32 layer vs float64 oracle over a handful of positions.
ATOL, RTOL = 2e-5, 1e-4


def mamba_ssm_state_dict(d_model, d_state=16, d_conv=4, expand=2, seed=0, bias=False):
    """A state dict with the keys and shapes mamba-ssm's `Mamba` (mamba_simple.py) has, with
    values drawn here (not by our layer): in_proj (2 Di, d), conv1d (Di, 1, W) + bias, x_proj
    (R + 2N, Di), dt_proj (Di, R) + bias, A_log (Di, N), D (Di), out_proj (d, Di)."""
    g = torch.Generator().manual_seed(seed)
    Di, R = expand * d_model, math.ceil(d_model / 16)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    sd = {
        "in_proj.weight": rand(2 * Di, d_model),
        "conv1d.weight": rand(Di, 1, d_conv),
        "conv1d.bias": rand(Di),
        "x_proj.weight": rand(R + 2 * d_state, Di),
        "dt_proj.weight": rand(Di, R),
        "dt_proj.bias": rand(Di) - 3.0,
        "A_log": torch.log(torch.arange(1, d_state + 1.0)).repeat(Di, 1)
        + rand(Di, d_state, scale=0.1),
        "D": 1 + rand(Di),
        "out_proj.weight": rand(d_model, Di),
    }
    if bias:
        sd["in_proj.bias"] = rand(2 * Di)
        sd["out_proj.bias"] = rand(d_model)
    return sd


def fla_delta_net_state_dict(hidden, num_heads, conv_size=4, seed=0):
    """Keys and shapes of fla's `DeltaNet` layer with use_beta, use_short_conv, no gate."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    return {
        "q_proj.weight": rand(hidden, hidden),
        "k_proj.weight": rand(hidden, hidden),
        "v_proj.weight": rand(hidden, hidden),
        "b_proj.weight": rand(num_heads, hidden),
        "q_conv1d.weight": rand(hidden, 1, conv_size),
        "k_conv1d.weight": rand(hidden, 1, conv_size),
        "v_conv1d.weight": rand(hidden, 1, conv_size),
        "o_norm.weight": 1 + rand(hidden // num_heads),
        "o_proj.weight": rand(hidden, hidden),
    }


@pytest.mark.parametrize("d_conv", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_mamba_loads_mamba_ssm_state_dict_and_matches_equations(d_conv, bias):
    torch.manual_seed(0)
    sd = mamba_ssm_state_dict(16, d_conv=d_conv, bias=bias)
    layer = Mamba(16, d_conv=d_conv, bias=bias)
    assert set(layer.state_dict()) == set(sd)
    layer.load_state_dict(sd, strict=True)
    u = torch.randn(2, 9, 16)
    expected, _ = mamba_reference(sd, u)
    torch.testing.assert_close(layer(u).double(), expected, atol=ATOL, rtol=RTOL)


def test_mamba_without_conv_matches_equations():
    torch.manual_seed(0)
    sd = mamba_ssm_state_dict(16)
    del sd["conv1d.weight"], sd["conv1d.bias"]
    layer = Mamba(16, use_conv=False)
    layer.load_state_dict(sd, strict=True)
    u = torch.randn(2, 7, 16)
    expected, _ = mamba_reference(sd, u, use_conv=False)
    torch.testing.assert_close(layer(u).double(), expected, atol=ATOL, rtol=RTOL)


def test_mamba_initialisation_is_mamba_ssms():
    torch.manual_seed(0)
    layer = Mamba(32, d_state=8, dt_min=0.001, dt_max=0.1)
    Di = 64
    assert layer.dt_rank == 2
    shapes = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert shapes == {
        "in_proj.weight": (2 * Di, 32),
        "conv1d.weight": (Di, 1, 4),
        "conv1d.bias": (Di,),
        "x_proj.weight": (2 + 16, Di),
        "dt_proj.weight": (Di, 2),
        "dt_proj.bias": (Di,),
        "A_log": (Di, 8),
        "D": (Di,),
        "out_proj.weight": (32, Di),
    }
    torch.testing.assert_close(-torch.exp(layer.A_log), -torch.arange(1, 9.0).repeat(Di, 1))
    torch.testing.assert_close(layer.D.detach(), torch.ones(Di))
    dt = F.softplus(layer.dt_proj.bias.detach())
    assert dt.min() >= 0.001 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    bound = 2**-0.5
    assert layer.dt_proj.weight.abs().max() <= bound


def test_delta_net_loads_fla_state_dict_and_matches_equations():
    torch.manual_seed(0)
    sd = fla_delta_net_state_dict(16, num_heads=2)
    layer = DeltaNet(hidden_size=16, num_heads=2)
    assert set(layer.state_dict()) == set(sd)
    layer.load_state_dict(sd, strict=True)
    u = torch.randn(2, 9, 16)
    expected, _ = delta_net_reference(sd, u, num_heads=2)
    torch.testing.assert_close(layer(u).double(), expected, atol=ATOL, rtol=RTOL)


def test_delta_net_without_short_conv_matches_equations():
    torch.manual_seed(0)
    sd = fla_delta_net_state_dict(16, num_heads=1)
    for n in "qkv":
        del sd[f"{n}_conv1d.weight"]
    layer = DeltaNet(d_model=16, num_heads=1, use_short_conv=False)
    layer.load_state_dict(sd, strict=True)
    u = torch.randn(2, 7, 16)
    expected, _ = delta_net_reference(sd, u, num_heads=1, use_short_conv=False)
    torch.testing.assert_close(layer(u).double(), expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("width", [1, 3, 4])
def test_short_convolution_is_a_causal_depthwise_conv(activation, width):
    torch.manual_seed(0)
    conv = ShortConvolution(6, width, bias=True, activation=activation)
    assert isinstance(conv, torch.nn.Conv1d) and conv.weight.shape == (6, 1, width)
    x = torch.randn(2, 7, 6)
    y, state = conv(x)
    expected = causal_depthwise_conv(x.double(), conv.weight.double(), conv.bias.double())
    if activation == "silu":
        expected = F.silu(expected)
    assert state is None
    torch.testing.assert_close(y.double(), expected, atol=1e-6, rtol=1e-5)
    # Streaming: two halves with the carried state equal one call.
    y1, s1 = conv(x[:, :3], output_final_state=True)
    y2, _ = conv(x[:, 3:], cache=s1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y)


def test_layers_refuse_bad_arguments():
    with pytest.raises(ValueError, match="d_conv"):
        Mamba(16, d_conv=9)
    with pytest.raises(ValueError, match="dt_init"):
        Mamba(16, dt_init="zeros")
    with pytest.raises(ValueError, match="num_heads"):
        DeltaNet(hidden_size=16, num_heads=3)
    with pytest.raises(ValueError, match="qk_norm"):
        DeltaNet(hidden_size=16, num_heads=1, qk_norm="max")
    with pytest.raises(ValueError, match="expand_v"):
        GatedDeltaNet(hidden_size=16, num_heads=1, head_dim=3, expand_v=0.5)
    with pytest.raises(ValueError, match="activation"):
        ShortConvolution(4, 3, activation="relu")
    with pytest.raises(ValueError, match="kernel_size"):
        ShortConvolution(4, 9)


@pytest.mark.parametrize("length", [1, 9, DIRECT_MAX_LEN + 7])
def test_long_causal_conv_is_a_causal_convolution(length):
    torch.manual_seed(0)
    u = torch.randn(2, length, 3, dtype=torch.float64)
    k = torch.randn(length + 2, 3, dtype=torch.float64)  # extra taps are ignored
    expected = torch.zeros_like(u)
    for t in range(length):
        for s in range(t + 1):
            expected[:, t] += k[s] * u[:, t - s]
    torch.testing.assert_close(long_causal_conv(u, k), expected)
    torch.testing.assert_close(
        long_causal_conv(u.float(), k.float()).double(), expected, atol=1e-4, rtol=1e-4
    )
    # Only the last outputs, as a resumed segment asks for them.
    for last in {1, (length + 1) // 2, length}:
        torch.testing.assert_close(long_causal_conv(u, k, last=last), expected[:, -last:])
    # A short filter counts as zero-padded.
    short = k[:2]
    torch.testing.assert_close(
        long_causal_conv(u, short), long_causal_conv(u, torch.cat([short, 0 * k[2:]]))
    )


def test_direct_long_conv_is_exactly_causal():
    u = torch.randn(2, 37, 4)
    k = torch.randn(37, 4)
    changed = u.clone()
    changed[:, 20] += 1e3
    assert torch.equal(long_causal_conv(changed, k)[:, :20], long_causal_conv(u, k)[:, :20])


@pytest.mark.parametrize("d_state", [8, 64])
def test_h3_equals_its_two_recurrences(d_state):
    """Both SSMs as recurrences (float64 oracle) against the layer's FFT/Toeplitz convolutions,
    with a trained-like shift B (not the initial e_1) and the study's head_dim 2."""
    from mecheval.layers import H3
    from tests.layers.references import h3_reference

    torch.manual_seed(0)
    layer = H3(8, d_state=d_state, head_dim=2)
    with torch.no_grad():
        layer.shift_B.add_(0.3 * torch.randn_like(layer.shift_B))
        for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.output_linear):
            linear.bias.normal_()
    params = dict(layer.named_parameters())
    u = torch.randn(2, 11, 8)
    expected = h3_reference(params, u, head_dim=2)
    torch.testing.assert_close(layer(u).double(), expected, atol=ATOL, rtol=RTOL)


def test_implicit_filters_start_from_the_study_positional_encoding():
    from mecheval.layers import Hyena
    from mecheval.layers.base_conv import BaseConv
    from tests.layers.references import positional_encoding_reference

    z = positional_encoding_reference(1024)
    torch.testing.assert_close(Hyena(8, 1024).filter_fn.z.double(), z)
    torch.testing.assert_close(BaseConv(8, 1024, kernel_size=-1).conv.z.double(), z)


def test_hyena_and_long_base_conv_equal_their_definitions():
    from mecheval.layers import Hyena
    from mecheval.layers.base_conv import BaseConv
    from tests.layers.references import base_conv_long_reference, hyena_reference

    torch.manual_seed(0)
    l_max = 64
    hyena = Hyena(8, l_max, filter_order=16)
    base_conv = BaseConv(8, l_max, kernel_size=-1)
    with torch.no_grad():  # trained-like: move every parameter off its initial value
        for module in (hyena, base_conv):
            for p in module.parameters():
                p.add_(0.1 * torch.randn_like(p))
    u = torch.randn(2, 13, 8)
    expected = hyena_reference(dict(hyena.named_parameters()), u, l_max)
    torch.testing.assert_close(hyena(u).double(), expected, atol=ATOL, rtol=RTOL)
    expected = base_conv_long_reference(dict(base_conv.named_parameters()), u)
    torch.testing.assert_close(base_conv(u).double(), expected, atol=ATOL, rtol=RTOL)


def test_attention_takes_flash_attn_on_cuda_half_precision(monkeypatch):
    """On CUDA in fp16/bf16 with flash-attn installed, the causal pass runs flash-attn's kernel
    in its (B, L, H, head_dim) layout; elsewhere SDPA. (A stand-in plays the kernel on CPU.)"""
    import torch.nn.functional as F

    from mecheval.layers import attention

    calls = []

    def stand_in(q, k, v, causal):
        calls.append((q.shape, causal))
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        )
        return y.transpose(1, 2)

    layer = attention.CausalSelfAttention(16, num_heads=2)
    x = torch.randn(3, 5, 16)
    expected = layer(x)
    assert not attention.uses_flash_attn(x)  # CPU: SDPA
    monkeypatch.setattr(attention, "flash_attn_func", lambda: stand_in)
    monkeypatch.setattr(attention, "uses_flash_attn", lambda q: True)
    torch.testing.assert_close(layer(x), expected)
    assert calls == [((3, 5, 2, 8), True)]
