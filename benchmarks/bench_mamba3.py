"""Mamba-3's scan (SISO, and MIMO at the model's size): forward and forward+backward, ours vs
the per-step reference vs mamba-ssm's kernels.

On a GPU (bf16 inputs): our Triton core, the PyTorch path, the per-step reference
(mecheval_kernels.mamba3.reference: mamba-ssm's own references live in its tests, not its
package) and, when installed, mamba-ssm's `mamba3_siso_combined`. On CPU (fp32): the PyTorch
path (chunked core) vs the per-step reference, side by side.

Shapes: the study's model (d_model 64: B32 L37, 8 heads of P 16, N 64, as the zoo's mamba3), the
shape mamba-ssm tunes its SISO kernel for (B4 L2048 H32 P64 N128) and a narrower one (B1 L2048
H8) on which the reference's backward fits in a CPU's memory; MIMO rank 4 at the model's shape.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from benchmarks.common import DEVICE, DTYPE, installed, run_benchmark
from mecheval_kernels import mamba3_mimo, mamba3_siso_combined
from mecheval_kernels.mamba3 import mamba3_ref

# (B, L, H, P, N, rank)
SHAPES = {
    "model B32 L37 H8 P16 N64": (32, 37, 8, 16, 64, 1),
    "model-mimo4 B32 L37 H8 P16 N64": (32, 37, 8, 16, 64, 4),
    "long B4 L2048 H32 P64 N128": (4, 2048, 32, 64, 128, 1),
    "long-narrow B1 L2048 H8 P64 N128": (1, 2048, 8, 64, 128, 1),
}


def _ours(backend: str) -> Callable:
    def call(args, rank):
        if rank == 1:
            return mamba3_siso_combined(*args, backend=backend)
        return mamba3_mimo(*args[:11], args[11], args[12], args[13], 64, 4, DTYPE,
                           backend=backend)  # fmt: skip

    return call


def _reference(args, rank):
    if rank == 1:
        Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, D, Z = args
        out, _ = mamba3_ref(Q[:, :, None], K[:, :, None], V, ADT, DT, Trap, Qb[:, None],
                            Kb[:, None], Ang, D, Z)  # fmt: skip
        return out[:, :, 0]
    Q, K, V, ADT, DT, Trap, Qb, Kb, mv, mz, mo, Ang, D, Z = args
    return mamba3_ref(Q, K, V, ADT, DT, Trap, Qb, Kb, Ang, D, Z, None, mv, mz, mo, "halves")[0]


def _implementations() -> dict[str, Callable]:
    impls: dict[str, Callable] = {"reference": _reference}
    if DEVICE.type == "cuda":
        impls["ours (triton)"] = _ours("triton")
        if installed("mamba_ssm"):
            from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined

            impls["mamba-ssm"] = lambda args, rank: mamba3_siso_combined(*args)
    impls["ours (torch)"] = _ours("torch")
    return impls


IMPLS = _implementations()


def _operands(B, L, H, P, N, R, backward: bool) -> list[torch.Tensor]:
    """As mamba-ssm's layer forms them: RMS-normed B and C, dt = softplus(.), A dt <= 0, angles
    for half the state (float32: the layer keeps them so)."""
    gen = torch.Generator().manual_seed(0)
    make = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    leaf = lambda t, dtype=DTYPE: t.to(DEVICE, dtype).requires_grad_(backward)  # noqa: E731
    f32 = torch.float32
    qk = (1, R) if R > 1 else ()
    Q, K = (F.normalize(make(B, L, *qk[1:], 1, N), dim=-1) * N**0.5 for _ in range(2))
    dt = F.softplus(make(B, H, L) - 2)
    bias = (H, R, N) if R > 1 else (H, N)
    args = [leaf(Q), leaf(K), leaf(make(B, L, H, P)), leaf(-dt * torch.rand(B, H, L), f32),
            leaf(dt, f32), leaf(make(B, H, L)), leaf(torch.ones(bias), f32),
            leaf(torch.ones(bias), f32)]  # fmt: skip
    if R > 1:
        args += [leaf(torch.full((H, R, P), 1 / R), f32) for _ in range(3)]
    return args + [leaf(make(B, L, H, N // 4), f32), leaf(torch.ones(H), f32),
                   leaf(make(B, L, H, P))]  # fmt: skip


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_mamba3(benchmark, copy_bandwidth, impl, shape, pass_):
    B, L, H, P, N, R = SHAPES[shape]
    backward = pass_ == "forward+backward"
    if impl == "reference" and backward and B * H * P * N * L > 2**28:
        pytest.skip("the reference's autograd would keep every step's state")
    if impl == "mamba-ssm" and R > 1:
        pytest.skip("mamba-ssm's MIMO kernels are TileLang's, not timed here")
    fn = IMPLS[impl]
    args = _operands(B, L, H, P, N, R, backward)
    do = torch.randn(B, L, H, P).to(DEVICE, DTYPE)

    def step():
        out = fn(args, R)
        if backward:
            torch.autograd.backward(out, do.to(out.dtype))
        return out

    size = torch.finfo(DTYPE).bits // 8
    inputs = B * L * (2 * R * N + 2 * H * P) * size + B * L * H * (3 * 4 + N // 4 * 4)
    output = B * L * H * P * size
    nbytes = inputs + output + (2 * inputs + output if backward else 0)
    benchmark.group = f"mamba3 {shape} {pass_}"
    run_benchmark(
        benchmark,
        step,
        nbytes=nbytes,
        copy_bandwidth=copy_bandwidth,
        slow=impl == "reference" and L >= 2048,
        op="mamba3_siso_combined" if R == 1 else "mamba3_mimo",
        impl=impl,
        shape=shape,
        dtype=str(DTYPE),
        pass_=pass_,
    )
