"""Comba (chunk_comba): forward and forward+backward, ours vs flash-linear-attention's.

On CPU (fp32): our PyTorch path vs fla 0.6.0's naive_chunk_comba (the naive reference fla's
kernels match; its naive_recurrent_comba decays before the recall) and our per-step reference.
On a GPU (bf16): our Triton path and PyTorch path vs fla's chunk_comba and its naive reference.
Shapes as benchmarks/bench_gated_delta_rule.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DTYPE, installed, run_benchmark
from mecheval_kernels import chunk_comba
from mecheval_kernels.comba import comba_ref

SHAPES = {
    "model B32 T37 H1 K=V=64": (32, 37, 1, 64, 64),
    "long B4 T2048 H16 K=V=128": (4, 2048, 16, 128, 128),
    "long-narrow B1 T2048 H4 K=V=128": (1, 2048, 4, 128, 128),
}


def _ours(backend: str) -> Callable:
    def call(q, k, v, p, g, beta):
        return chunk_comba(q, k, v, p, g, beta, backend=backend)

    return call


def _implementations() -> dict[str, Callable]:
    impls: dict[str, Callable] = {"reference": comba_ref}
    if installed("fla"):
        from fla.ops.comba.naive import naive_chunk_comba

        impls["fla naive"] = naive_chunk_comba
    if DEVICE.type == "cuda":
        impls["ours (triton)"] = _ours("triton")
        if installed("fla"):
            from fla.ops.comba import chunk_comba as peer

            impls["fla"] = peer
    impls["ours (torch)"] = _ours("torch")
    return impls


IMPLS = _implementations()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_comba(benchmark, copy_bandwidth, impl, shape, pass_):
    B, T, H, K, V = SHAPES[shape]
    backward = pass_ == "forward+backward"
    on_cpu = DEVICE.type == "cpu"
    if impl == "reference" and backward and on_cpu and B * H * K * V * T > 2**28:
        pytest.skip("the per-step reference's autograd would keep every step's state (~16 GB)")
    fn = IMPLS[impl]
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    leaf = lambda t, dtype=DTYPE: t.to(DEVICE, dtype).requires_grad_(backward)  # noqa: E731
    unit = lambda: leaf(F.normalize(make(B, T, H, K), dim=-1))  # noqa: E731
    q, k, p, v = unit(), unit(), unit(), leaf(make(B, T, H, V))
    g = leaf(F.logsigmoid(make(B, T, H) + 2), torch.float32)  # models keep g in float32
    beta = leaf(torch.rand(B, T, H, generator=gen))
    do = make(B, T, H, V).to(DEVICE, DTYPE)

    def step():
        o, _ = fn(q, k, v, p, g, beta)
        if backward:
            torch.autograd.backward(o, do)
        return o

    size = torch.finfo(DTYPE).bits // 8
    inputs = B * T * H * ((3 * K + V + 1) * size + 4)  # q, k, p, v, beta; g in float32
    output = B * T * H * V * size
    nbytes = inputs + output + (2 * inputs + output if backward else 0)
    benchmark.group = f"comba {shape} {pass_}"
    run_benchmark(
        benchmark,
        step,
        nbytes=nbytes,
        copy_bandwidth=copy_bandwidth,
        slow=on_cpu and T >= 2048 and impl in ("reference", "fla naive"),
        op="chunk_comba",
        impl=impl,
        shape=shape,
        dtype=str(DTYPE),
        pass_=pass_,
    )
