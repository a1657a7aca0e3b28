"""Short causal conv1d: forward and forward+backward, ours vs the fp32 reference, vs the simplest
library-call version (causal-conv1d's own reference: one grouped F.conv1d, then SiLU, with
autograd's backward) and vs causal-conv1d's CUDA kernel when installed.

On a GPU: the Triton path (bf16). On CPU: the PyTorch path (fp32), which must be at least as
fast as the F.conv1d version. Shapes: the study's model shape and a long one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DTYPE, installed, run_benchmark
from mecheval_kernels import causal_conv1d_fn
from mecheval_kernels.short_conv import causal_conv1d_ref

SHAPES = {"model B32 D128 L37 W4": (32, 128, 37, 4), "long B8 D2048 L4096 W4": (8, 2048, 4096, 4)}


def conv1d_library(x, weight, bias=None, activation=None):
    """causal-conv1d's `causal_conv1d_ref` without initial states: the library-call version."""
    width = weight.shape[1]
    y = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
    y = y[..., : x.shape[-1]]
    return F.silu(y) if activation in ("silu", "swish") else y


def _implementations() -> dict:
    impls = {"reference": causal_conv1d_ref, "F.conv1d": conv1d_library}
    if DEVICE.type == "cuda":
        impls["ours (triton)"] = lambda *a, **k: causal_conv1d_fn(*a, **k, backend="triton")
        if installed("causal_conv1d"):
            from causal_conv1d import causal_conv1d_fn as peer

            impls["causal-conv1d"] = peer
    else:
        impls["ours (torch)"] = lambda *a, **k: causal_conv1d_fn(*a, **k, backend="torch")
    return impls


IMPLS = _implementations()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_short_conv(benchmark, copy_bandwidth, impl, shape, pass_):
    B, D, L, W = SHAPES[shape]
    fn = IMPLS[impl]
    backward = pass_ == "forward+backward"
    x = torch.randn(B, D, L, device=DEVICE, dtype=DTYPE, requires_grad=backward)
    weight = torch.randn(D, W, device=DEVICE, dtype=DTYPE, requires_grad=backward)
    bias = torch.randn(D, device=DEVICE, dtype=DTYPE, requires_grad=backward)
    dy = torch.randn(B, D, L, device=DEVICE, dtype=DTYPE)

    def step():
        y = fn(x, weight, bias, activation="silu")
        if backward:
            torch.autograd.backward(y, dy)
        return y

    elements = B * D * L * x.element_size()
    # forward: read x, write y; backward: read x and dy, write dx.
    nbytes = elements * (5 if backward else 2)
    benchmark.group = f"short_conv {shape} {pass_}"
    slow = impl == "reference" and L >= 4096 and DEVICE.type == "cpu"
    run_benchmark(
        benchmark,
        step,
        nbytes=nbytes,
        copy_bandwidth=copy_bandwidth,
        slow=slow,
        op="causal_conv1d_fn",
        impl=impl,
        shape=shape,
        dtype=str(DTYPE),
        pass_=pass_,
    )
