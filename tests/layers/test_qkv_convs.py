"""What the gated delta rules share on ShortConvQKV (mecheval/layers/qkv_convs.py): the log
decays -exp(A_log) softplus(u W_a + dt_bias) and the gated output o_proj(norm(o) * act(u W_g))
of Gated DeltaNet, Comba (a sigmoid gate) and Gated DeltaProduct, against the formulas written
out with fla's gated RMSNorm (tests/layers/fla_layers.py) on randomly drawn parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mecheval.layers import Comba, GatedDeltaNet, GatedDeltaProduct
from tests.layers.fla_layers import gated_rmsnorm

SIZES = dict(hidden_size=16, num_heads=2, head_dim=4, expand_v=2)
LAYERS = {
    "gated_deltanet": lambda: GatedDeltaNet(**SIZES),
    "comba": lambda: Comba(**SIZES),
    "gated_deltaproduct": lambda: GatedDeltaProduct(**SIZES),
}
GATE = {"gated_deltanet": "swish", "comba": "sigmoid", "gated_deltaproduct": "swish"}  # as fla


def _drawn(make) -> torch.nn.Module:
    """The layer with every parameter redrawn (norm weights away from one)."""
    torch.manual_seed(0)
    layer = make()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(0.5 * torch.randn_like(parameter))
    return layer


@pytest.mark.parametrize("name", list(LAYERS))
def test_decays_are_flas_formula(name):
    layer = _drawn(LAYERS[name])
    u = torch.randn(3, 5, 16)
    step = u.double() @ layer.a_proj.weight.double().T + layer.dt_bias.double()
    expected = -layer.A_log.double().exp() * F.softplus(step)
    got = layer._decay(u)
    assert got.dtype == torch.float32 and got.shape == (3, 5, 2)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", list(LAYERS))
def test_gated_output_is_the_gated_norm_then_o_proj(name):
    layer = _drawn(LAYERS[name])
    u, o = torch.randn(3, 5, 16), torch.randn(3, 5, 2, 8)
    gate = (u @ layer.g_proj.weight.T).unflatten(-1, (2, 8))
    normed = gated_rmsnorm(o, gate, layer.o_norm.weight, GATE[name], layer.o_norm.eps)
    expected = normed.flatten(-2) @ layer.o_proj.weight.T
    torch.testing.assert_close(layer._gated_output(o, u, None, True), expected)
    at = torch.tensor([4, 0, 2])  # the gate read at one position per row
    picked = layer._gated_output(o[torch.arange(3), at][:, None], u, at, True)
    torch.testing.assert_close(picked, expected[torch.arange(3), at][:, None])
