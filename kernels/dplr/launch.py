"""Host side of the DPLR delta rule's Triton kernels (recurrent.py): block sizes, launches, the
checkpoints kept for the backward, the fixed-order reductions, and the launch configurations the
Hopper compile check compiles.

Every buffer is allocated with torch.empty (`_empty`) and fully written before it is read (the
tests make them start as NaN to check it).
"""

from __future__ import annotations

import torch
import triton

from mecheval_kernels._launch import Launch
from mecheval_kernels.dplr.op import DplrArgs
from mecheval_kernels.dplr.recurrent import dplr_bwd_kernel, dplr_fwd_kernel

# Steps between the checkpoints the forward stores and the backward replays from: the
# backward keeps C + 1 state tiles per program in a scratch buffer.
CHECKPOINT = 16
# Programs below which the kernels split V further (down to 16 columns).
MIN_PROGRAMS = 128
# The state tile's largest size (floats): the backward holds three such tiles.
TILE = 4096


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def launches(K: int, V: int, programs: int, **flags: bool) -> dict[str, Launch]:
    """The forward and backward kernels: a (BK, BV) float32 state tile, BK = K padded to a power
    of two, BV at most TILE / BK and narrower while there are fewer than MIN_PROGRAMS programs."""
    BK = _pow2(K)
    BV = min(_pow2(V), max(16, TILE // BK))
    while BV > 16 and triton.cdiv(V, BV) * programs < MIN_PROGRAMS:
        BV //= 2
    warps = 8 if BK * BV >= TILE else 4
    pick = lambda kernel: {k: v for k, v in flags.items() if k in kernel.arg_names}  # noqa: E731
    common = dict(C=CHECKPOINT, BK=BK, BV=BV)
    return {
        "forward": Launch(dplr_fwd_kernel, {**common, **pick(dplr_fwd_kernel)}, warps),
        "backward": Launch(dplr_bwd_kernel, {**common, **pick(dplr_bwd_kernel)}, warps),
    }


def _empty(like: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An unfilled buffer on `like`'s device (see the module docstring)."""
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def empty_saved(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The checkpoints, unfilled: the state at the start of every chunk of CHECKPOINT steps,
    (B, H, NT, K, V) float32."""
    B, T, H, K = q.shape
    return _empty(q, B, H, triton.cdiv(T, CHECKPOINT), K, v.shape[-1], dtype=torch.float32)


def _contiguous(a: DplrArgs) -> list[torch.Tensor]:
    return [t.contiguous() for t in (a.q, a.k, a.v, a.a, a.b, a.gk)]


def forward(a: DplrArgs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """o (B, T, H, V) in q's dtype, the final state (B, H, K, V) float32 or None, and the
    checkpoints (`empty_saved`)."""
    q, k, v, aa, bb, g = _contiguous(a)
    init = None if a.initial_state is None else a.initial_state.contiguous()
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = _empty(q, B, T, H, V)
    final = _empty(q, B, H, K, V, dtype=torch.float32) if a.output_final_state else None
    h = empty_saved(q, v)
    if B == 0:
        return o, final, h
    launch = launches(K, V, B * H, HAS_INIT=init is not None, STORE_FINAL=final is not None)
    launch = launch["forward"]
    # Absent optional tensors: any valid pointer, never touched (the flags are compile-time).
    launch((triton.cdiv(V, launch.constants["BV"]), B * H),
           q, k, v, aa, bb, g, o if init is None else init, o, h, o if final is None else final,
           a.scale, T, H, K, V, h.shape[2])  # fmt: skip
    return o, final, h


def backward(a: DplrArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (dq, dk, dv, da, db, dgk, dinitial_state), None for an absent initial state;
    those summed over V blocks in float32."""
    q, k, v, aa, bb, g = _contiguous(a)
    do = grads[0].contiguous()
    dfinal = grads[1].contiguous() if a.output_final_state and grads[1] is not None else None
    (h,) = saved
    B, T, H, K = q.shape
    V = v.shape[-1]
    f32 = torch.float32
    dv = torch.empty_like(v)
    dinit = None if a.initial_state is None else _empty(q, B, H, K, V, dtype=f32)
    if B == 0:
        zeros = [torch.zeros_like(t, dtype=f32) for t in (q, k)]
        return [*zeros, dv, *(torch.zeros_like(t, dtype=f32) for t in (aa, bb, g)), dinit]
    flags = dict(HAS_DFINAL=dfinal is not None, STORE_DINIT=dinit is not None)
    launch = launches(K, V, B * H, **flags)["backward"]
    BK, BV = launch.constants["BK"], launch.constants["BV"]
    NV = triton.cdiv(V, BV)
    parts = [_empty(q, NV, B, T, H, K, dtype=f32) for _ in range(5)]
    scratch = _empty(q, B * H * NV, CHECKPOINT + 1, BK, BV, dtype=f32)
    dfinal_arg = dv if dfinal is None else dfinal
    dinit_arg = dv if dinit is None else dinit
    launch((NV, B * H), q, k, v, aa, bb, g, h, do, dfinal_arg, scratch, *parts, dv, dinit_arg,
           a.scale, B, T, H, K, V, h.shape[2])  # fmt: skip
    # Fixed-order sums over the V blocks: deterministic.
    dq, dk, da, db, dg = (p.sum(0) for p in parts)
    return [dq, dk, dv, da, db, dg, dinit]


# Pointers to float32 buffers whatever the input dtype (states, scratch, partial sums), and gk,
# which models compute in float32.
FLOAT32_POINTERS = frozenset(
    {"g_ptr", "init_ptr", "final_ptr", "h_ptr", "dfinal_ptr", "scratch_ptr", "dinit_ptr"}
    | {f"d{x}_part_ptr" for x in ("q", "k", "a", "b", "g")}
)


def hopper_specialisations() -> list:
    """The launch configurations to compile-check for sm_90 (mecheval_kernels.compile_check):
    both kernels as the host code launches them, at RWKV-7's head size in bf16, a padded head
    (K = 100, V = 36) in fp16 and the largest head in fp32."""
    from mecheval_kernels.compile_check import Specialisation

    flags = dict(HAS_INIT=True, STORE_FINAL=True, HAS_DFINAL=True, STORE_DINIT=True)
    specs = []
    for K, V, dtype in (
        (64, 64, torch.bfloat16),
        (100, 36, torch.float16),
        (256, 256, torch.float32),
    ):
        for launch in launches(K, V, 64, **flags).values():
            specs.append(
                Specialisation(
                    launch,
                    dtype,
                    float32_pointers=FLOAT32_POINTERS,
                    float_scalars=frozenset({"scale"}),
                )
            )
    return specs
