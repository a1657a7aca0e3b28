"""Host side of Mamba-3's core Triton kernels (recurrent.py): block sizes, launches, the
checkpoints kept for the backward, the fixed-order reductions, and the launch configurations the
Hopper compile check compiles. Every buffer is allocated with torch.empty and fully written
before it is read."""

from __future__ import annotations

import torch
import triton

from mecheval_kernels._launch import Launch
from mecheval_kernels.mamba3.core import CoreArgs
from mecheval_kernels.mamba3.recurrent import core_bwd_kernel, core_fwd_kernel

# Steps between the checkpoints the forward stores and the backward replays from.
CHECKPOINT = 16
MIN_PROGRAMS = 128  # programs below which the kernels split P further (down to 16 rows)
TILE = 4096  # the state tile's largest size (floats)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def launches(N: int, P: int, R: int, programs: int, **flags: bool) -> dict[str, Launch]:
    """The forward and backward kernels: a (BP, BN) float32 state tile, BN = N padded to a power
    of two, BP at most TILE / BN and narrower while there are fewer than MIN_PROGRAMS programs."""
    BN = _pow2(N)
    BP = min(_pow2(P), max(16, TILE // BN))
    while BP > 16 and triton.cdiv(P, BP) * programs < MIN_PROGRAMS:
        BP //= 2
    warps = 8 if BP * BN >= TILE else 4
    pick = lambda kernel: {k: v for k, v in flags.items() if k in kernel.arg_names}  # noqa: E731
    common = dict(R=R, C=CHECKPOINT, BP=BP, BN=BN)
    return {
        "forward": Launch(core_fwd_kernel, {**common, **pick(core_fwd_kernel)}, warps),
        "backward": Launch(core_bwd_kernel, {**common, **pick(core_bwd_kernel)}, warps),
    }


def _empty(like: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def empty_saved(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The checkpoints, unfilled: (B, H, NT, P, N) float32."""
    B, L, R, H, N = q.shape
    return _empty(q, B, H, triton.cdiv(L, CHECKPOINT), v.shape[-1], N, dtype=torch.float32)


def forward(a: CoreArgs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """y (B, L, R, H, P) in q's dtype, the final state (B, H, P, N) float32 or None, and the
    checkpoints."""
    q, k, v, aa, s = (t.contiguous() for t in (a.q, a.k, a.v, a.a, a.s))
    init = None if a.initial_state is None else a.initial_state.contiguous()
    B, L, R, H, N = q.shape
    P = v.shape[-1]
    y = _empty(q, B, L, R, H, P)
    final = _empty(q, B, H, P, N, dtype=torch.float32) if a.output_final_state else None
    h = empty_saved(q, v)
    if B == 0:
        return y, final, h
    flags = dict(HAS_INIT=init is not None, STORE_FINAL=final is not None)
    launch = launches(N, P, R, B * H, **flags)["forward"]
    launch((triton.cdiv(P, launch.constants["BP"]), B * H),
           q, k, v, aa, s, y if init is None else init, y, h, y if final is None else final,
           L, H, N, P, h.shape[2])  # fmt: skip
    return y, final, h


def backward(a: CoreArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (dq, dk, dv, da, ds, dinitial_state), None for an absent initial state."""
    q, k, v, aa, s = (t.contiguous() for t in (a.q, a.k, a.v, a.a, a.s))
    dy = grads[0].contiguous()
    dfinal = grads[1].contiguous() if a.output_final_state and grads[1] is not None else None
    (h,) = saved
    B, L, R, H, N = q.shape
    P = v.shape[-1]
    f32 = torch.float32
    dv = torch.empty_like(v)
    dinit = None if a.initial_state is None else _empty(q, B, H, P, N, dtype=f32)
    if B == 0:
        zeros = [torch.zeros_like(t, dtype=f32) for t in (q, k)]
        return [*zeros, dv, torch.zeros_like(aa, dtype=f32), torch.zeros_like(s, dtype=f32), dinit]
    flags = dict(HAS_DFINAL=dfinal is not None, STORE_DINIT=dinit is not None)
    launch = launches(N, P, R, B * H, **flags)["backward"]
    BP, BN = launch.constants["BP"], launch.constants["BN"]
    NP = triton.cdiv(P, BP)
    dq_part, dk_part = (_empty(q, NP, B, L, R, H, N, dtype=f32) for _ in range(2))
    ds_part, da_part = (_empty(q, NP, B, L, H, dtype=f32) for _ in range(2))
    scratch = _empty(q, B * H * NP, CHECKPOINT + 1, BP, BN, dtype=f32)
    dfinal_arg = dv if dfinal is None else dfinal
    dinit_arg = dv if dinit is None else dinit
    launch((NP, B * H), q, k, v, aa, s, h, dy, dfinal_arg, scratch, dq_part, dk_part, ds_part,
           da_part, dv, dinit_arg, B, L, H, N, P, h.shape[2])  # fmt: skip
    # Fixed-order sums over the P blocks: deterministic.
    dq, dk, ds, da = (p.sum(0) for p in (dq_part, dk_part, ds_part, da_part))
    return [dq, dk, dv, da, ds, dinit]


FLOAT32_POINTERS = frozenset(
    {"q_ptr", "k_ptr", "v_ptr", "a_ptr", "s_ptr", "y_ptr", "dy_ptr", "dv_ptr"}
    | {"init_ptr", "h_ptr", "final_ptr", "dfinal_ptr", "scratch_ptr", "dinit_ptr"}
    | {f"d{x}_part_ptr" for x in ("q", "k", "s", "a")}
)


def hopper_specialisations() -> list:
    """The launch configurations to compile-check for sm_90 (mecheval_kernels.compile_check):
    both kernels as the host code launches them (the core always runs in float32), SISO at
    mamba-ssm's head (N 128, P 64), MIMO rank 4 at N 64, P 64, and a padded head (N 100, P 36)."""
    from mecheval_kernels.compile_check import Specialisation

    flags = dict(HAS_INIT=True, STORE_FINAL=True, HAS_DFINAL=True, STORE_DINIT=True)
    specs = []
    for N, P, R in ((128, 64, 1), (64, 64, 4), (100, 36, 1)):
        for launch in launches(N, P, R, 64, **flags).values():
            specs.append(Specialisation(launch, torch.float32, FLOAT32_POINTERS))
    return specs
