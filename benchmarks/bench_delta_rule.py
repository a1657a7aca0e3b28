"""Delta rule: forward and forward+backward, ours vs the fp32 recurrence vs fla's chunk_delta_rule.

On a GPU (bf16): our Triton path as dispatched (recurrent kernel for short sequences, chunked for
long ones), each Triton kernel forced, the PyTorch path, the reference recurrence, and
flash-linear-attention's `chunk_delta_rule` when installed. On CPU (fp32): the PyTorch path
(chunked WY form) vs the reference recurrence.

Shapes: the study's model (B32 T37 H1 K=V=64), the long one of the GPU target (B4 T2048 H16
K=V=128), and a narrower T=2048 one (B1 H4) on which the reference's backward fits in a CPU's
memory (its autograd keeps every step's state: ~16 GB at the long shape).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DTYPE, installed, run_benchmark
from mecheval_kernels import chunk_delta_rule
from mecheval_kernels.delta_rule import delta_rule_ref, op

SHAPES = {
    "model B32 T37 H1 K=V=64": (32, 37, 1, 64, 64),
    "long B4 T2048 H16 K=V=128": (4, 2048, 16, 128, 128),
    "long-narrow B1 T2048 H4 K=V=128": (1, 2048, 4, 128, 128),
}


@contextmanager
def _forced_kernel(kernel: str) -> Iterator[None]:
    previous = op.RECURRENT_MAX_LEN
    op.RECURRENT_MAX_LEN = 1 << 30 if kernel == "recurrent" else 0
    try:
        yield
    finally:
        op.RECURRENT_MAX_LEN = previous


def _ours(backend: str, kernel: str | None = None) -> Callable:
    def call(*args, **kwargs):
        if kernel is None:
            return chunk_delta_rule(*args, **kwargs, backend=backend)
        with _forced_kernel(kernel):
            return chunk_delta_rule(*args, **kwargs, backend=backend)

    return call


def _implementations() -> dict[str, Callable]:
    impls: dict[str, Callable] = {"reference": delta_rule_ref}
    if DEVICE.type == "cuda":
        impls["ours (triton)"] = _ours("triton")
        impls["ours (triton chunked)"] = _ours("triton", "chunked")
        impls["ours (triton recurrent)"] = _ours("triton", "recurrent")
        impls["ours (torch)"] = _ours("torch")
        if installed("fla"):
            from fla.ops.delta_rule import chunk_delta_rule as peer

            impls["fla"] = peer
    else:
        impls["ours (torch)"] = _ours("torch")
    return impls


IMPLS = _implementations()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_delta_rule(benchmark, copy_bandwidth, impl, shape, pass_):
    B, T, H, K, V = SHAPES[shape]
    backward = pass_ == "forward+backward"
    on_cpu = DEVICE.type == "cpu"
    if impl == "reference" and backward and on_cpu and B * H * K * V * T > 2**28:
        pytest.skip("the reference's autograd would keep every step's state (~16 GB)")
    fn = IMPLS[impl]
    g = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    leaf = lambda t: t.to(DEVICE, DTYPE).requires_grad_(backward)  # noqa: E731
    q, k, v = (
        leaf(make(B, T, H, K)),
        leaf(F.normalize(make(B, T, H, K), dim=-1)),
        leaf(make(B, T, H, V)),
    )
    beta = leaf(torch.rand(B, T, H, generator=g))
    do = make(B, T, H, V).to(DEVICE, DTYPE)

    def step():
        o, _ = fn(q, k, v, beta)
        if backward:
            torch.autograd.backward(o, do)
        return o

    size = torch.finfo(DTYPE).bits // 8
    inputs = B * T * H * (2 * K + V + 1) * size  # q, k, v, beta
    output = B * T * H * V * size
    # forward: read the inputs, write o; backward: read the inputs and do, write their grads.
    nbytes = inputs + output + (2 * inputs + output if backward else 0)
    benchmark.group = f"delta_rule {shape} {pass_}"
    slow = on_cpu and T >= 2048 and impl == "reference"
    run_benchmark(
        benchmark,
        step,
        nbytes=nbytes,
        copy_bandwidth=copy_bandwidth,
        slow=slow,
        op="chunk_delta_rule",
        impl=impl,
        shape=shape,
        dtype=str(DTYPE),
        pass_=pass_,
    )
