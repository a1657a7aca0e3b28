"""Gated DeltaProduct (chunk_gated_delta_product, two Householder steps a token): forward and
forward+backward, ours vs flash-linear-attention's.

On CPU (fp32): our PyTorch path (the gated delta rule over the 2 T steps) vs fla 0.6.0's
naive_recurrent_gated_delta_product and our per-token reference. On a GPU (bf16): our Triton
path and PyTorch path vs fla's chunk_gated_delta_product and its naive reference. Shapes as
benchmarks/bench_gated_delta_rule.py, T counting tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DTYPE, installed, run_benchmark
from mecheval_kernels import chunk_gated_delta_product
from mecheval_kernels.gated_delta_product import gated_delta_product_ref

N = 2  # Householder steps a token
SHAPES = {
    "model B32 T37 H1 K=V=64": (32, 37, 1, 64, 64),
    "long B4 T2048 H16 K=V=128": (4, 2048, 16, 128, 128),
    "long-narrow B1 T2048 H4 K=V=128": (1, 2048, 4, 128, 128),
}


def _ours(backend: str) -> Callable:
    def call(q, k, v, g, beta):
        return chunk_gated_delta_product(q, k, v, g, beta, N, backend=backend)

    return call


def _fla_naive(q, k, v, g, beta):
    from fla.ops.gated_delta_product.naive import naive_recurrent_gated_delta_product

    return naive_recurrent_gated_delta_product(
        q, k, v, g, beta, q.shape[-1] ** -0.5, num_householder=N
    )


def _implementations() -> dict[str, Callable]:
    impls: dict[str, Callable] = {
        "reference": lambda q, k, v, g, beta: gated_delta_product_ref(q, k, v, g, beta, N)
    }
    if installed("fla"):
        impls["fla naive"] = _fla_naive
    if DEVICE.type == "cuda":
        impls["ours (triton)"] = _ours("triton")
        if installed("fla"):
            from fla.ops.gated_delta_product import chunk_gated_delta_product as peer

            impls["fla"] = lambda q, k, v, g, beta: peer(q, k, v, g, beta, N)
    impls["ours (torch)"] = _ours("torch")
    return impls


IMPLS = _implementations()


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_gated_delta_product(benchmark, copy_bandwidth, impl, shape, pass_):
    B, T, H, K, V = SHAPES[shape]
    backward = pass_ == "forward+backward"
    on_cpu = DEVICE.type == "cpu"
    per_step = impl in ("reference", "fla naive")
    if per_step and backward and on_cpu and N * B * H * K * V * T > 2**28:
        pytest.skip("the per-step reference's autograd would keep every step's state (~32 GB)")
    fn = IMPLS[impl]
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    leaf = lambda t, dtype=DTYPE: t.to(DEVICE, dtype).requires_grad_(backward)  # noqa: E731
    q = leaf(F.normalize(make(B, T, H, K), dim=-1))
    k = leaf(F.normalize(make(B, N * T, H, K), dim=-1))
    v = leaf(make(B, N * T, H, V))
    g = leaf(F.logsigmoid(make(B, T, H) + 2), torch.float32)  # models keep g in float32
    beta = leaf(torch.rand(B, N * T, H, generator=gen))
    do = make(B, T, H, V).to(DEVICE, DTYPE)

    def step():
        o, _ = fn(q, k, v, g, beta)
        if backward:
            torch.autograd.backward(o, do)
        return o

    size = torch.finfo(DTYPE).bits // 8
    inputs = B * T * H * ((K + N * (K + V + 1)) * size + 4)  # q, k, v, beta; g in float32
    output = B * T * H * V * size
    nbytes = inputs + output + (2 * inputs + output if backward else 0)
    benchmark.group = f"gated_delta_product {shape} {pass_}"
    run_benchmark(
        benchmark,
        step,
        nbytes=nbytes,
        copy_bandwidth=copy_bandwidth,
        slow=on_cpu and T >= 2048 and per_step,
        op="chunk_gated_delta_product",
        impl=impl,
        shape=shape,
        dtype=str(DTYPE),
        pass_=pass_,
    )
