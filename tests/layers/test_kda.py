"""mecheval.layers.KDA against flash-linear-attention 0.6.0's KimiDeltaAttention: fla's layer's
state dict loads strictly, and the output equals a float64 transcription of fla's layer forward
that runs fla's naive_recurrent_kda (and fla's naive gates)."""

from __future__ import annotations

import pytest
import torch

from mecheval.layers import KDA
from mecheval.testing import check_mixer
from tests.layers.fla_layers import (
    fla_layer,
    float64,
    gated_rmsnorm,
    l2norm,
    shapes,
    short_conv,
)

fla_naive = pytest.importorskip("fla.ops.kda.naive")
# The layer in float64 against the float64 transcription; its output norm computes in float32 (as
# fla's fused norm does), hence float32-level tolerances.
RTOL, ATOL = 1e-5, 1e-6
fla_gate = pytest.importorskip("fla.ops.kda.gate")


def fla_forward(p: dict, x: torch.Tensor, H: int, K: int, options: dict) -> torch.Tensor:
    """fla's KimiDeltaAttention.forward in float64 on parameters `p`, its chunk_kda replaced by
    fla's naive reference (the in-kernel gate, beta sigmoid and l2norm applied before it)."""
    B, L, _ = x.shape
    q, k, v = (short_conv(x @ p[f"{n}_proj.weight"].T, p[f"{n}_conv1d.weight"]) for n in "qkv")
    raw = (x @ p["f_proj.0.weight"].T @ p["f_proj.1.weight"].T).view(B, L, H, K)
    with float64(fla_gate):
        if options.get("lower_bound") is None:
            g = fla_gate.naive_kda_gate(raw, p["A_log"], p["dt_bias"], output_dtype=torch.float64)
        else:
            g = fla_gate.naive_kda_lowerbound_gate(
                raw, p["A_log"], p["dt_bias"], options["lower_bound"], torch.float64
            )
    beta = (x @ p["b_proj.weight"].T).sigmoid() * (2 if options.get("allow_neg_eigval") else 1)
    q, k = l2norm(q.view(B, L, H, K)), l2norm(k.view(B, L, H, K))
    with float64(fla_naive):
        o, _ = fla_naive.naive_recurrent_kda(q, k, v.view(B, L, H, -1), g, beta)
    gate = x @ p["g_proj.0.weight"].T @ p["g_proj.1.weight"].T + p["g_proj.1.bias"]
    o = gated_rmsnorm(o, gate.view(B, L, H, -1), p["o_norm.weight"], "sigmoid")
    return o.flatten(2) @ p["o_proj.weight"].T


@pytest.mark.parametrize(
    "options",
    [{}, {"allow_neg_eigval": True}, {"safe_gate": True, "lower_bound": -4.0}, {"expand_v": 2.0}],
    ids=["default", "neg_eigval", "safe_gate", "expand_v"],
)
def test_loads_fla_state_dict_and_matches_fla_forward(options):
    sizes = dict(hidden_size=24, head_dim=8, num_heads=3)
    theirs = fla_layer("KimiDeltaAttention", **sizes, **options)
    ours = KDA(**sizes, **options)
    assert shapes(ours) == shapes(theirs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 11, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    p = {n: t.double() for n, t in theirs.state_dict().items()}
    expected = fla_forward(p, x, 3, 8, options)
    got = ours.double()(x)
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)


def test_passes_check_mixer():
    report = check_mixer("kda", options={"num_heads": 2})
    assert not report.failed


def test_refuses_grouped_value_heads_and_unsafe_bounds():
    with pytest.raises(ValueError, match="num_v_heads 4 != num_heads 2"):
        KDA(hidden_size=16, head_dim=8, num_heads=2, num_v_heads=4)
    with pytest.raises(ValueError, match=r"safe_gate needs lower_bound in \[-5, 0\)"):
        KDA(hidden_size=16, head_dim=8, num_heads=2, safe_gate=True)
