"""mecheval.layers.Comba against flash-linear-attention 0.6.0's Comba: fla's layer's state dict
loads strictly, and the output equals a float64 transcription of fla's layer forward that runs
fla's naive_chunk_comba (what fla's chunk and fused recurrent kernels compute)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from mecheval.layers import Comba
from mecheval.testing import check_mixer
from tests.layers.fla_layers import (
    fla_layer,
    float64,
    gated_rmsnorm,
    l2norm,
    shapes,
    short_conv,
)

fla_naive = pytest.importorskip("fla.ops.comba.naive")
# The layer in float64 against the float64 transcription; its output norm computes in float32 (as
# fla's fused norm does), hence float32-level tolerances.
RTOL, ATOL = 1e-5, 1e-6


def fla_forward(p: dict, x: torch.Tensor, H: int, K: int, options: dict) -> torch.Tensor:
    """fla's Comba.forward in float64 on parameters `p`, its chunk kernel replaced by fla's
    naive chunk reference (q, k, p l2-normalised before it, as the kernel does)."""
    B, L, _ = x.shape
    q, k, v = (short_conv(x @ p[f"{m}_proj.weight"].T, p[f"{m}_conv1d.weight"]) for m in "qkv")
    q, k, v = q.view(B, L, H, K), k.view(B, L, H, K), v.view(B, L, H, -1)
    recall = k * p["decay"][:, None].sigmoid() if options.get("use_inner_decay", True) else k
    if options.get("use_output_correction", True):
        q = q - p["D"][:, None] * recall
    beta = (x @ p["b_proj.weight"].T).sigmoid()
    g = -p["A_log"].exp() * F.softplus(x @ p["a_proj.weight"].T + p["dt_bias"])
    with float64(fla_naive):
        o, _ = fla_naive.naive_chunk_comba(
            l2norm(q), l2norm(k), v, l2norm(recall), g, beta, chunk_size=4
        )
    gate = (x @ p["g_proj.weight"].T).view(B, L, H, -1)
    o = gated_rmsnorm(o, gate, p["o_norm.weight"], "sigmoid")
    return o.flatten(2) @ p["o_proj.weight"].T


@pytest.mark.parametrize(
    "options",
    [{}, {"use_inner_decay": False, "use_output_correction": False}, {"correction_factor": 0.02}],
    ids=["default", "plain", "small_correction"],
)
def test_loads_fla_state_dict_and_matches_fla_forward(options):
    sizes = dict(hidden_size=24, head_dim=8, num_heads=3)
    with warnings.catch_warnings():  # fla's layer warns about its correction_factor default
        warnings.simplefilter("ignore", UserWarning)
        theirs = fla_layer("Comba", **sizes, **options)
    ours = Comba(**sizes, **options)
    assert shapes(ours) == shapes(theirs)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(2, 11, 24, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    p = {name: t.double() for name, t in theirs.state_dict().items()}
    expected = fla_forward(p, x, 3, 8, options)
    torch.testing.assert_close(ours.double()(x), expected, rtol=RTOL, atol=ATOL)


def test_passes_check_mixer():
    report = check_mixer("comba", options={"num_heads": 2, "correction_factor": 0.5})
    assert not report.failed
