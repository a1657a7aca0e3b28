"""GroupedQueryAttention and Rotary (mecheval/layers/grouped_attention.py): equal to attention
written from its definition (explicit scores and mask, rotary as a complex rotation of channel
pairs (i, i + D/2), key/value heads repeated per group), and conforming to the mixer contract
(check_mixer: causal, resumable, read-out at positions, the grid equal to the per-cell loop)."""

from __future__ import annotations

import functools

import pytest
import torch

from mecheval.layers.grouped_attention import GroupedQueryAttention, Rotary
from mecheval.layers.mlp import MLP, GatedMLP
from mecheval.testing import check_mixer


def _reference(layer: GroupedQueryAttention, x: torch.Tensor) -> torch.Tensor:
    """The layer's output in float64, one head and one query at a time."""
    B, L, _ = x.shape
    H, G, D = layer.num_heads, layer.num_kv_heads, layer.head_dim
    x = x.double()
    lin = lambda m, t: t @ m.weight.double().T + (0 if m.bias is None else m.bias.double())  # noqa: E731
    q = lin(layer.q_proj, x).view(B, L, H, D)
    k = lin(layer.k_proj, x).view(B, L, G, D)
    v = lin(layer.v_proj, x).view(B, L, G, D)
    if layer.rotary is not None:
        angles = torch.arange(L, dtype=torch.float64)[:, None] * layer.rotary.inv_freq.double()
        turn = torch.polar(torch.ones_like(angles), angles) * layer.rotary.scaling  # (L, D/2)

        def rotate(t):
            pairs = torch.complex(t[..., : D // 2], t[..., D // 2 :]) * turn[:, None]
            return torch.cat([pairs.real, pairs.imag], -1)

        q, k = rotate(q), rotate(k)
    out = torch.zeros(B, L, H, D, dtype=torch.float64)
    for h in range(H):
        g = h // (H // G)
        for t in range(L):
            scores = (k[:, : t + 1, g] @ q[:, t, h, :, None])[..., 0] * layer.scale  # (B, t+1)
            out[:, t, h] = (scores.softmax(-1)[..., None] * v[:, : t + 1, g]).sum(1)
    return lin(layer.o_proj, out.flatten(2))


def _rotary(head_dim: int, scaling: float = 1.0) -> Rotary:
    return Rotary(1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim), scaling)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, rotary, bias",
    [(4, 4, 8, False, True), (4, 2, 8, True, False), (4, 1, 6, True, True), (2, 2, 8, True, False)],
)
def test_equals_its_definition(heads, kv_heads, head_dim, rotary, bias):
    torch.manual_seed(0)
    layer = GroupedQueryAttention(
        32, heads, kv_heads, head_dim, qkv_bias=bias, out_bias=bias,
        rotary=_rotary(head_dim, 1.2) if rotary else None, scale=0.3 if bias else None,
    )  # fmt: skip
    x = torch.randn(3, 11, 32)
    torch.testing.assert_close(layer(x).double(), _reference(layer, x), atol=1e-5, rtol=1e-5)


def _mixer(d_model: int, kind: str) -> GroupedQueryAttention:
    if kind == "gqa_rotary":
        return GroupedQueryAttention(d_model, 4, 2, rotary=_rotary(d_model // 4))
    return GroupedQueryAttention(d_model, 2, qkv_bias=True, out_bias=True)


@pytest.mark.parametrize("kind", ["gqa_rotary", "biases"])
def test_passes_the_mixer_contract(kind):
    report = check_mixer(functools.partial(_mixer, kind=kind), d_model=16)
    passed = {c.name.rsplit(" ", 1)[-1] for c in report.checks if c.passed}
    assert {"forward", "causal", "resumable", "reads_out_at", "grid"} <= passed


def test_refuses_bad_shapes():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        GroupedQueryAttention(32, 4, 3)
    with pytest.raises(ValueError, match="rotary covers 4 channels"):
        GroupedQueryAttention(32, 4, rotary=_rotary(4))
    with pytest.raises(ValueError, match="inv_freq must be 1-D"):
        Rotary(torch.ones(2, 2))


def test_mlps_equal_their_definitions():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    gated = GatedMLP(8, 12, "silu", bias=True)
    silu = lambda t: t * torch.sigmoid(t)  # noqa: E731
    expected = gated.down_proj(silu(gated.gate_proj(x)) * gated.up_proj(x))
    torch.testing.assert_close(gated(x), expected)
    mlp = MLP(8, hidden=20, act="gelu_new")
    h = mlp.fc1(x)
    tanh_gelu = 0.5 * h * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3)))
    torch.testing.assert_close(mlp(x), mlp.fc2(tanh_gelu))
    with pytest.raises(ValueError, match="unknown activation 'tanhh'"):
        GatedMLP(8, 12, "tanhh")
