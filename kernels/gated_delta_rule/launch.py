"""Host side of the gated delta rule's Triton kernels: block sizes, launches, saved buffers,
the fixed-order reductions, and the launch configurations the Hopper compile check compiles.
The block sizes and warps are the delta rule's (kernels/delta_rule/launch.py), whose kernels
these extend with a few (C,) and (C, C) float32 tiles.

Every kernel reads only what earlier launches wrote (on one stream, so in order), and no two
programs of a launch write the same element. Buffers are allocated with torch.empty (`_empty`)
and each is fully written before it is read: the tests make them start as NaN to check it.
"""

from __future__ import annotations

import torch
import triton

from kernels.delta_rule.common import CHUNK, SUB_BLOCK
from kernels.delta_rule.launch import (
    INVERSE_WARPS,
    _empty,
    _launch,
    _pow2,
    _split_for_parallelism,
)
from kernels.gated_delta_rule.backward import chunk_grad_kernel, chunk_state_bwd_kernel
from kernels.gated_delta_rule.forward import (
    chunk_inverse_kernel,
    chunk_output_kernel,
    chunk_state_fwd_kernel,
)
from kernels.gated_delta_rule.op import GatedDeltaArgs


def chunked_launches(K: int, V: int, dtype: torch.dtype, programs: int, **flags: bool) -> dict:
    """The chunked kernels (see kernels.delta_rule.launch.chunked_launches for the sizes)."""
    BK, ieee = _pow2(K), dtype == torch.float32
    state_bv = _split_for_parallelism(
        min(_pow2(V), 32 if BK <= 32 and not ieee else 16), V, programs
    )
    if ieee:
        out_bv = min(_pow2(V), 32 if BK <= 64 else 16)
    else:
        out_bv = min(_pow2(V), 64 if BK <= 128 else 32)
    state_warps = 4 if BK <= 32 else 8
    common = dict(C=CHUNK, IEEE=ieee)
    return {
        "inverse": _launch(
            chunk_inverse_kernel, flags, INVERSE_WARPS, SB=SUB_BLOCK, BK=min(BK, 64), **common
        ),
        "state_fwd": _launch(
            chunk_state_fwd_kernel, flags, state_warps, BK=BK, BV=state_bv, **common
        ),
        "output": _launch(
            chunk_output_kernel, flags, 8 if BK >= 64 else 4, BK=BK, BV=out_bv, **common
        ),
        "state_bwd": _launch(
            chunk_state_bwd_kernel, flags, state_warps, BK=BK, BV=state_bv, **common
        ),
        "grad": _launch(chunk_grad_kernel, flags, 4, 1, BK=min(BK, 32), BV=16, **common),
    }


def empty_saved(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The forward's saved buffers, unfilled: u (B, H, T, V) and h (B, H, NT, K, V) in
    float32, and A (B, H, NT, C, C) in float32 for float32 inputs, else in the inputs' dtype
    (it only ever enters tl.dot as a half-precision operand). The decays are recomputed from g
    by every kernel that needs them (a (C, C) cumulative sum)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    f32 = torch.float32
    NT = triton.cdiv(T, CHUNK)
    a_dtype = f32 if q.dtype == f32 else q.dtype
    return (
        _empty(q, B, H, T, V, dtype=f32),
        _empty(q, B, H, NT, K, V, dtype=f32),
        _empty(q, B, H, NT, CHUNK, CHUNK, dtype=a_dtype),
    )


def forward(a: GatedDeltaArgs) -> tuple[torch.Tensor, ...]:
    """o (B, T, H, V) in q's dtype, the final state (B, H, K, V) float32 or None, and the
    buffers the backward needs (see `empty_saved`)."""
    q, k, v, g, beta = (t.contiguous() for t in (a.q, a.k, a.v, a.g, a.beta))
    init = None if a.initial_state is None else a.initial_state.contiguous()
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = _empty(q, B, T, H, V)
    final = _empty(q, B, H, K, V, dtype=torch.float32) if a.output_final_state else None
    saved = empty_saved(q, v)
    if B == 0:
        return o, final, *saved
    u, h, A = saved
    # Absent optional tensors: any valid pointer, never read (the flags are compile-time).
    init_arg = init if init is not None else o
    final_arg = final if final is not None else o
    flags = dict(HAS_INIT=init is not None, STORE_FINAL=final is not None)
    NT = triton.cdiv(T, CHUNK)
    launches = chunked_launches(K, V, q.dtype, B * H, **flags)
    launches["inverse"]((NT, B * H), k, g, beta, A, T, H, K, NT)
    launch = launches["state_fwd"]
    launch((triton.cdiv(V, launch.constants["BV"]), B * H),
           k, v, g, beta, A, init_arg, h, u, final_arg, T, H, K, V, NT)  # fmt: skip
    launch = launches["output"]
    launch((triton.cdiv(V, launch.constants["BV"]), NT, B * H),
           q, k, g, h, u, o, a.scale, T, H, K, V, NT)  # fmt: skip
    return o, final, *saved


def backward(a: GatedDeltaArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (dq, dk, dv, dg, dbeta, dinitial_state), None for an absent initial_state;
    dg and dbeta in float32."""
    q, k, v, g, beta, do = (t.contiguous() for t in (a.q, a.k, a.v, a.g, a.beta, grads[0]))
    init = None if a.initial_state is None else a.initial_state.contiguous()
    dfinal = grads[1].contiguous() if a.output_final_state else None
    B, T, H, K = q.shape
    V = v.shape[-1]
    u, h, A = saved
    f32 = torch.float32
    dv = torch.empty_like(v)
    dinit = None if init is None else _empty(q, B, H, K, V, dtype=f32)
    if B == 0:
        zeros = torch.zeros_like
        return [zeros(q), zeros(k), dv, zeros(a.g, dtype=f32), zeros(beta, dtype=f32), dinit]
    dinit_arg = dinit if dinit is not None else dv
    dfinal_arg = dfinal if dfinal is not None else dv
    flags = dict(HAS_DFINAL=dfinal is not None, STORE_DINIT=dinit is not None)
    NT = triton.cdiv(T, CHUNK)
    dh = torch.empty_like(h)
    dr = torch.empty_like(u)
    launches = chunked_launches(K, V, q.dtype, B * H, **flags)
    launch = launches["state_bwd"]
    launch((triton.cdiv(V, launch.constants["BV"]), B * H),
           q, k, g, beta, A, do, dfinal_arg, dh, dr, dinit_arg, a.scale, T, H, K, V,
           NT)  # fmt: skip
    launch = launches["grad"]
    NK = triton.cdiv(K, launch.constants["BK"])
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dbeta_part = _empty(q, NK, B, T, H, dtype=f32)
    dg_part = _empty(q, NK, B, T, H, dtype=f32)
    launch((NK, NT, B * H), q, k, v, g, beta, h, dh, u, dr, do, dq, dk, dv, dbeta_part,
           dg_part, a.scale, B, T, H, K, V, NT)  # fmt: skip
    # Fixed-order sums over the K blocks: deterministic.
    return [dq, dk, dv, dg_part.sum(0), dbeta_part.sum(0), dinit]


# Pointers to float32 buffers whatever the input dtype (states, u rows, partial sums), and g,
# which models compute in float32 (fla's layer does too) whatever the dtype of q, k, v.
FLOAT32_POINTERS = frozenset(
    {
        "g_ptr",
        "init_ptr",
        "final_ptr",
        "h_ptr",
        "u_ptr",
        "dfinal_ptr",
        "dinit_ptr",
        "dh_ptr",
        "dr_ptr",
        "dbeta_part_ptr",
        "dg_part_ptr",
    }
)


def hopper_specialisations() -> list:
    """The launch configurations to compile-check for sm_90 (see kernels.compile_check): every
    kernel as the host code launches it, at the benchmark's head size in bf16, a padded head
    (K=100, V=36) in fp16 and the largest head in fp32 (the most shared memory). None may use
    wgmma (see kernels.delta_rule.common.CHUNK)."""
    from kernels.compile_check import Specialisation

    flags = dict(HAS_INIT=True, STORE_FINAL=True, HAS_DFINAL=True, STORE_DINIT=True)
    specs = []
    for K, V, dtype in (
        (128, 128, torch.bfloat16),
        (100, 36, torch.float16),
        (256, 256, torch.float32),
    ):
        for launch in chunked_launches(K, V, dtype, 64, **flags).values():
            specs.append(
                Specialisation(
                    launch,
                    dtype,
                    float32_pointers=FLOAT32_POINTERS,
                    float_scalars=frozenset({"scale"}),
                    allow_wgmma=False,
                )
            )
    return specs
