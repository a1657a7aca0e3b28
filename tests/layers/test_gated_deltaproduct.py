"""mecheval.layers.GatedDeltaProduct against flash-linear-attention 0.6.0's GatedDeltaProduct:
fla's layer's state dict loads strictly, and the output equals a float64 transcription of fla's
layer forward that runs fla's naive_recurrent_gated_delta_product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mecheval.layers import GatedDeltaProduct
from mecheval.testing import check_mixer
from tests.layers.fla_layers import (
    fla_layer,
    float64,
    gated_rmsnorm,
    l2norm,
    shapes,
    short_conv,
)

fla_naive = pytest.importorskip("fla.ops.gated_delta_product.naive")
# The layer in float64 against the float64 transcription; its output norm computes in float32 (as
# fla's fused norm does), hence float32-level tolerances.
RTOL, ATOL = 1e-5, 1e-6


def fla_forward(p: dict, x: torch.Tensor, H: int, K: int, n: int, options: dict) -> torch.Tensor:
    """fla's GatedDeltaProduct.forward in float64 on parameters `p`, its chunk kernel replaced
    by fla's naive reference."""
    B, L, _ = x.shape
    q, k, v = (short_conv(x @ p[f"{m}_proj.weight"].T, p[f"{m}_conv1d.weight"]) for m in "qkv")
    q = l2norm(q.view(B, L, H, K))
    k = l2norm(k.reshape(B, L * n, H, K))  # fla: '... t (n h d) -> ... (t n) h d'
    v = v.reshape(B, L * n, H, -1)
    beta = (x @ p["b_proj.weight"].T).sigmoid()
    beta = 2 * beta if options.get("allow_neg_eigval", True) else beta
    g = None
    if options.get("use_forget_gate", True):
        g = -p["A_log"].exp() * F.softplus(x @ p["a_proj.weight"].T + p["dt_bias"])
    with float64(fla_naive):
        o, _ = fla_naive.naive_recurrent_gated_delta_product(
            q, k, v, g, beta.reshape(B, L * n, H), K**-0.5, num_householder=n
        )
    if options.get("use_output_gate", True):
        gate = (x @ p["g_proj.weight"].T).view(B, L, H, -1)
        o = gated_rmsnorm(o, gate, p["o_norm.weight"], "swish")
    else:
        o = o * torch.rsqrt(o.square().mean(-1, keepdim=True) + 1e-5) * p["o_norm.weight"]
    return o.flatten(2) @ p["o_proj.weight"].T


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_householder": 3, "allow_neg_eigval": False},
        {"use_forget_gate": False},
        {"use_output_gate": False, "expand_v": 1.0},
    ],
    ids=["default", "three_steps", "no_forget_gate", "no_output_gate"],
)
def test_loads_fla_state_dict_and_matches_fla_forward(options):
    sizes = dict(hidden_size=24, head_dim=8, num_heads=3)
    theirs = fla_layer("GatedDeltaProduct", **sizes, **options)
    ours = GatedDeltaProduct(**sizes, **options)
    assert shapes(ours) == shapes(theirs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 11, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    p = {name: t.double() for name, t in theirs.state_dict().items()}
    n = options.get("num_householder", 2)
    expected = fla_forward(p, x, 3, 8, n, options)
    torch.testing.assert_close(ours.double()(x), expected, rtol=RTOL, atol=ATOL)


def test_passes_check_mixer():
    report = check_mixer("gated_deltaproduct", options={"num_householder": 3})
    assert not report.failed


def test_state_size_counts_every_steps_window():
    layer = GatedDeltaProduct(hidden_size=16, head_dim=8, num_heads=2, expand_v=1.0,
                              num_householder=3)  # fmt: skip
    assert layer.state_size(10) == 2 * 8 * 8 + 3 * (16 + 3 * 16 + 3 * 16)
    with pytest.raises(ValueError, match="num_householder must be >= 1"):
        GatedDeltaProduct(hidden_size=16, head_dim=8, num_heads=2, num_householder=0)
