"""Mamba-2's scan (mecheval_kernels.mamba2_scan): forward and forward+backward, ours vs the per-step
reference and vs Mamba-2 run as a selective scan (the alternative it was measured against).

On CPU (fp32): ours is the chunked SSD path (backend "torch"); "as selective scan" is the same
call on the selective scan's PyTorch path (mamba2_scan's form for the Triton backend and for
its scan at positions, run here with backend "torch"); "reference" the per-step recurrence
with autograd.
On a GPU (bf16): ours is the Triton path (the selective scan's kernels) and mamba-ssm's
`mamba_chunk_scan_combined` when installed. Shapes: the study's, batch 32, d_model 64 and 256
(d_inner 128 and 512, headdim 16, d_state 64, one group), L 37 and 256. Every call: D, dt_bias,
softplus, no z (the layer gates in its RMSNorm).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import DEVICE, DTYPE, installed, run_benchmark
from mecheval_kernels import mamba2_scan
from mecheval_kernels.scan_at import Asked
from mecheval_kernels.ssd import mamba2_scan_ref
from mecheval_kernels.ssd.chunked import Inputs
from mecheval_kernels.ssd.op import on_selective_scan

# name -> (batch, length, heads, head dim, groups, state)
SHAPES = {
    "d64 L37": (32, 37, 8, 16, 1, 64),
    "d64 L256": (32, 256, 8, 16, 1, 64),
    "d256 L37": (32, 37, 32, 16, 1, 64),
    "d256 L256": (32, 256, 32, 16, 1, 64),
}


def _as_selective_scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, backend):
    inputs = Inputs(x, dt, A, B, C, D, z, dt_bias, dt_softplus, None)
    return on_selective_scan(inputs, backend, Asked()).out


def _ours(x, dt, A, B, C, D, z, dt_bias, dt_softplus, backend):
    return mamba2_scan(
        x, dt, A, B, C, None, D, z, dt_bias, dt_softplus=dt_softplus, backend=backend
    )


def _implementations() -> dict:
    impls = {"reference": lambda *a, backend: mamba2_scan_ref(*a)}
    if DEVICE.type == "cuda":
        impls["ours (triton)"] = lambda *a, backend: _ours(*a, backend="triton")
        if installed("mamba_ssm"):
            from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as peer

            impls["mamba-ssm"] = lambda x, dt, A, B, C, D, z, bias, sp, backend: peer(
                x, dt, A, B, C, 64, D=D, z=z, dt_bias=bias, dt_softplus=sp
            )
    else:
        impls["ours (torch, chunked)"] = lambda *a, backend: _ours(*a, backend="torch")
        impls["as selective scan (torch)"] = lambda *a, backend: _as_selective_scan(
            *a, backend="torch"
        )
    return impls


IMPLS = _implementations()


def _bytes(b: int, L: int, H: int, P: int, G: int, N: int, element: int, backward: bool) -> int:
    """Bytes that must move: forward reads x, dt, B, C and writes out; the backward reads them
    and dout again and writes dx, ddt, dB, dC (A, D and dt_bias are a few bytes)."""
    x, dt, bc = b * L * H * P * element, b * L * H * element, 2 * b * L * G * N * element
    forward = 2 * x + dt + bc
    return forward + (3 * x + 2 * dt + 2 * bc if backward else 0)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_mamba2_scan(benchmark, copy_bandwidth, impl, shape, pass_):
    b, L, H, P, G, N = SHAPES[shape]
    fn = IMPLS[impl]
    backward = pass_ == "forward+backward"
    g = torch.Generator().manual_seed(0)

    def make(*size, scale=1.0, dtype=DTYPE):
        t = (scale * torch.randn(*size, generator=g)).to(device=DEVICE, dtype=dtype)
        return t.requires_grad_(backward)

    x, dt = make(b, L, H, P), make(b, L, H, scale=0.5)
    Bm, Cm = make(b, L, G, N), make(b, L, G, N)
    # As the layer holds them: A, D and dt_bias in float32.
    A = (-torch.exp(torch.rand(H, generator=g) * 2.7)).to(DEVICE).requires_grad_(backward)
    Dv, bias = make(H, dtype=torch.float32), make(H, scale=0.3, dtype=torch.float32)
    dout = torch.randn(b, L, H, P, generator=g).to(device=DEVICE, dtype=DTYPE)

    def step():
        with torch.set_grad_enabled(backward):
            out = fn(x, dt, A, Bm, Cm, Dv, None, bias, True, backend=None)
            if backward:
                torch.autograd.backward(out, dout)
        return out

    benchmark.group = f"mamba2_scan {shape} {pass_}"
    # The reference's per-step autograd at L256 d256 takes seconds a call: one round.
    slow = impl == "reference" and L >= 256 and H >= 32
    run_benchmark(
        benchmark,
        step,
        nbytes=_bytes(b, L, H, P, G, N, x.element_size(), backward),
        copy_bandwidth=copy_bandwidth,
        slow=slow,
        op="mamba2_scan",
        impl=impl,
        shape=shape,
        dtype=str(DTYPE),
        pass_=pass_,
    )
