"""DPLR delta rule (RWKV-7's state update): forward and forward+backward, ours vs fla's naive
recurrence vs fla's chunk kernels.

On a GPU (bf16): our Triton path, the PyTorch path, fla 0.6.0's `dplr_recurrence` (its naive
reference) and, when installed, fla's `chunk_dplr_delta_rule` (its Triton chunk kernels). On CPU
(fp32): the PyTorch path (chunked WY form) vs fla's naive recurrence, side by side; ours is
timed as `chunk_dplr_delta_rule`, which `chunk_rwkv7` is.

Operands as RWKV-7's layer forms them: a = -kappa_hat, b = kappa_hat * a_gate, gk =
-exp(-1/2) sigmoid(.) (float32). Shapes: the study's model (B32 T37 H1 K=V=64, RWKV-7 at d_model
64 with one head), a GPU-sized long one (B4 T2048 H16 K=V=64, RWKV-7's head size) and a narrower
T=2048 one (B1 H4) on which fla's naive recurrence's backward fits in a CPU's memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DTYPE, installed, run_benchmark
from mecheval_kernels import chunk_dplr_delta_rule

SHAPES = {
    "model B32 T37 H1 K=V=64": (32, 37, 1, 64, 64),
    "long B4 T2048 H16 K=V=64": (4, 2048, 16, 64, 64),
    "long-narrow B1 T2048 H4 K=V=64": (1, 2048, 4, 64, 64),
}


def _ours(backend: str) -> Callable:
    def call(q, k, v, a, b, gk):
        return chunk_dplr_delta_rule(q, k, v, a, b, gk, backend=backend)

    return call


def _fla_naive(q, k, v, a, b, gk):
    """fla's naive recurrence (head-first layout, scale K ** -0.5, as ours by default)."""
    from fla.ops.generalized_delta_rule.dplr.naive import dplr_recurrence

    first = lambda t: t.transpose(1, 2)  # noqa: E731
    o, _ = dplr_recurrence(*(first(t) for t in (q, k, v, a, b, gk)), None, False)
    return first(o), None


def _implementations() -> dict[str, Callable]:
    impls: dict[str, Callable] = {}
    if installed("fla"):
        impls["fla naive"] = _fla_naive
    if DEVICE.type == "cuda":
        impls["ours (triton)"] = _ours("triton")
        if installed("fla"):
            from fla.ops.generalized_delta_rule import chunk_dplr_delta_rule as peer

            impls["fla"] = lambda *args: peer(*args)
    impls["ours (torch)"] = _ours("torch")
    return impls


IMPLS = _implementations()


def _operands(B, T, H, K, V, backward: bool):
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    leaf = lambda t, dtype=DTYPE: t.to(DEVICE, dtype).requires_grad_(backward)  # noqa: E731
    kappa = F.normalize(make(B, T, H, K), dim=-1)
    gate = torch.rand(B, T, H, K, generator=gen)
    gk = -math.exp(-0.5) * torch.sigmoid(make(B, T, H, K))
    return (leaf(make(B, T, H, K)), leaf(0.5 * make(B, T, H, K)), leaf(make(B, T, H, V)),
            leaf(-kappa), leaf(kappa * gate), leaf(gk, torch.float32))  # fmt: skip


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_dplr_delta_rule(benchmark, copy_bandwidth, impl, shape, pass_):
    B, T, H, K, V = SHAPES[shape]
    backward = pass_ == "forward+backward"
    naive = impl == "fla naive"
    if naive and backward and B * H * K * V * T > 2**28:
        pytest.skip("the naive recurrence's autograd would keep every step's state")
    fn = IMPLS[impl]
    operands = _operands(B, T, H, K, V, backward)
    do = torch.randn(B, T, H, V).to(DEVICE, DTYPE)

    def step():
        o, _ = fn(*operands)
        if backward:
            torch.autograd.backward(o, do)
        return o

    size = torch.finfo(DTYPE).bits // 8
    inputs = B * T * H * ((4 * K + V) * size + 4 * K)  # q, k, a, b, v; gk in float32
    output = B * T * H * V * size
    nbytes = inputs + output + (2 * inputs + output if backward else 0)
    benchmark.group = f"dplr_delta_rule {shape} {pass_}"
    run_benchmark(
        benchmark,
        step,
        nbytes=nbytes,
        copy_bandwidth=copy_bandwidth,
        slow=naive and T >= 2048,
        op="chunk_dplr_delta_rule",
        impl=impl,
        shape=shape,
        dtype=str(DTYPE),
        pass_=pass_,
    )
