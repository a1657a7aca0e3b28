"""Selective scan: forward and forward+backward, ours vs the per-step reference vs mamba-ssm.

On a GPU: the Triton path (bf16), the reference and mamba-ssm's CUDA kernel when installed, at
the study's model shape and at B8 D2048 N16 L2048. On CPU: the PyTorch path vs the reference
(fp32) at the model shape and at B8 D256 N16 L1024 (the long GPU shape would take the
reference hours on CPU). Every call: input-dependent B and C, D, z, delta_bias, softplus.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import DEVICE, DTYPE, installed, run_benchmark
from mecheval_kernels import selective_scan_fn
from mecheval_kernels.selective_scan import selective_scan_ref

if DEVICE.type == "cuda":
    SHAPES = {
        "model B32 D128 N16 L37": (32, 128, 16, 37),
        "long B8 D2048 N16 L2048": (8, 2048, 16, 2048),
    }
else:
    SHAPES = {
        "model B32 D128 N16 L37": (32, 128, 16, 37),
        "long B8 D256 N16 L1024": (8, 256, 16, 1024),
    }


def _implementations() -> dict:
    impls = {"reference": selective_scan_ref}
    if DEVICE.type == "cuda":
        impls["ours (triton)"] = lambda *a, **k: selective_scan_fn(*a, **k, backend="triton")
        if installed("mamba_ssm"):
            from mamba_ssm.ops.selective_scan_interface import selective_scan_fn as peer

            impls["mamba-ssm"] = peer
    else:
        impls["ours (torch)"] = lambda *a, **k: selective_scan_fn(*a, **k, backend="torch")
    return impls


IMPLS = _implementations()


def _bytes(B: int, D: int, N: int, L: int, element: int, backward: bool) -> int:
    """Bytes that must move: each input read once, each output written once.

    forward: read u, delta, z (B, D, L), B and C (B, N, L); write out.
    backward adds: read u, delta, z, dout, B, C; write du, ddelta, dz, dB, dC.
    (A, D and delta_bias are a few kilobytes.)
    """
    bdl, bnl = B * D * L * element, B * N * L * element
    forward = 4 * bdl + 2 * bnl
    return forward + (7 * bdl + 4 * bnl if backward else 0)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_selective_scan(benchmark, copy_bandwidth, impl, shape, pass_):
    B, D, N, L = SHAPES[shape]
    fn = IMPLS[impl]
    backward = pass_ == "forward+backward"
    g = torch.Generator().manual_seed(0)

    def make(*size, scale=1.0, dtype=DTYPE):
        t = (scale * torch.randn(*size, generator=g)).to(device=DEVICE, dtype=dtype)
        return t.requires_grad_(backward)

    u, delta, z = make(B, D, L), make(B, D, L, scale=0.5), make(B, D, L)
    Bm, Cm = make(B, N, L), make(B, N, L)
    # As Mamba holds them: A, D and delta_bias in float32.
    A = (-torch.exp(0.5 * torch.randn(D, N, generator=g))).to(DEVICE).requires_grad_(backward)
    Dv = make(D, dtype=torch.float32)
    bias = make(D, scale=0.3, dtype=torch.float32)
    dout = torch.randn(B, D, L, generator=g).to(device=DEVICE, dtype=DTYPE)

    def step():
        out = fn(u, delta, A, Bm, Cm, Dv, z, bias, delta_softplus=True)
        if backward:
            torch.autograd.backward(out, dout)
        return out

    benchmark.group = f"selective_scan {shape} {pass_}"
    # The reference's autograd backward over L steps takes ~100 s on CPU at L1024: one round.
    slow = impl == "reference" and L >= 1024
    run_benchmark(
        benchmark,
        step,
        nbytes=_bytes(B, D, N, L, u.element_size(), backward),
        copy_bandwidth=copy_bandwidth,
        slow=slow,
        op="selective_scan_fn",
        impl=impl,
        shape=shape,
        dtype=str(DTYPE),
        pass_=pass_,
    )
