"""Host side of the delta-rule family's Triton kernels: block sizes, launches, saved buffers,
the fixed-order reductions, and the launch configurations the Hopper compile check compiles.
The gated delta rule runs the same chunked kernels with USE_G on (the gate adds a few (C,) and
(C, C) float32 tiles, recomputed from g by every kernel that needs them); the recurrent kernels
are the delta rule's alone.

Every kernel reads only what earlier launches wrote (on one stream, so in order; the recurrent
backward's two passes aside, see recurrent.py), and no two programs of a launch write the same
element. Buffers are allocated with torch.empty (`_empty`) and each is fully written before it
is read: the tests make them start as NaN to check it.
"""

from __future__ import annotations

import torch
import triton

from mecheval_kernels._launch import Launch
from mecheval_kernels.delta_rule.backward import chunk_grad_kernel, chunk_state_bwd_kernel
from mecheval_kernels.delta_rule.common import CHUNK, KEY_CHUNK, SUB_BLOCK
from mecheval_kernels.delta_rule.forward import (
    chunk_inverse_kernel,
    chunk_output_kernel,
    chunk_state_fwd_kernel,
)
from mecheval_kernels.delta_rule.op import DeltaArgs
from mecheval_kernels.delta_rule.recurrent import recurrent_bwd_kernel, recurrent_fwd_kernel

INVERSE_WARPS = 4
# Programs below which the sequential kernels split V further (down to 16 columns).
MIN_PROGRAMS = 128
# K block of the (C, C, K block) Gamma tiles of a decay per key channel (USE_GK).
KEY_BLOCK = 32


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _split_for_parallelism(bv: int, V: int, programs: int) -> int:
    # The sequential kernels have one program per (V block, batch row, head).
    while bv > 16 and triton.cdiv(V, bv) * programs < MIN_PROGRAMS:
        bv //= 2
    return bv


def _launch(kernel, flags: dict, warps: int, stages: int | None = None, **constants) -> Launch:
    """A Launch of `kernel` with `constants` and those of the compile-time `flags` it takes."""
    constants.update({k: v for k, v in flags.items() if k in kernel.arg_names})
    return Launch(kernel, constants, warps, stages)


def recurrent_launches(K: int, V: int, programs: int, **flags: bool) -> dict[str, Launch]:
    """The fused recurrent kernels: a (BK, BV) float32 state tile of at most 4096 floats."""
    BK = _pow2(K)
    BV = _split_for_parallelism(min(_pow2(V), max(16, 4096 // BK)), V, programs)
    warps = 8 if BK * BV >= 4096 else 4
    return {
        "forward": _launch(recurrent_fwd_kernel, flags, warps, BK=BK, BV=BV),
        "backward": _launch(recurrent_bwd_kernel, flags, warps, BK=BK, BV=BV),
    }


def chunked_launches(
    K: int, V: int, dtype: torch.dtype, programs: int, **flags: bool
) -> dict[str, Launch]:
    """The chunked kernels. The state kernels hold the whole K in one tile, so their V blocks
    stay narrow (no register spills on sm_90 up to K = 128 in fp16/bf16); the output kernel is
    parallel over chunks, so wider V blocks; the gradient kernel holds two (C, C) and three
    (C, BK) float32 accumulators, so small tiles and single-stage loads. A decay per key channel
    (USE_GK) runs 16-step chunks whose (C, C, K block) Gamma tiles take K in blocks of
    KEY_BLOCK (16 in the gradient kernel, which holds one beside four (C, K block) products)."""
    BK, ieee = _pow2(K), dtype == torch.float32
    per_key = flags.get("USE_GK", False)
    chunk, grad_bk = (KEY_CHUNK, 16) if per_key else (CHUNK, min(BK, 32))
    key_block = min(BK, KEY_BLOCK)
    state_bv = _split_for_parallelism(
        min(_pow2(V), 32 if BK <= 32 and not ieee else 16), V, programs
    )
    if ieee:
        out_bv = min(_pow2(V), 32 if BK <= 64 else 16)
    else:
        out_bv = min(_pow2(V), 64 if BK <= 128 else 32)
    state_warps = 4 if BK <= 32 else 8
    common = dict(C=chunk, IEEE=ieee)
    inverse_bk = key_block if per_key else min(BK, 64)
    # Comba's reverse pass holds p's rows beside k's: at K = 256 in fp32 the default three-stage
    # pipeline needs more shared memory than sm_90 has (mecheval_kernels.compile_check).
    state_bwd_stages = 2 if flags.get("USE_P", False) and ieee and BK > 128 else None
    return {
        "inverse": _launch(
            chunk_inverse_kernel, flags, INVERSE_WARPS, SB=SUB_BLOCK, BK=inverse_bk, **common
        ),
        "state_fwd": _launch(
            chunk_state_fwd_kernel, flags, state_warps, BK=BK, BV=state_bv, **common
        ),
        "output": _launch(
            chunk_output_kernel,
            flags,
            8 if BK >= 64 else 4,
            BK=BK,
            BV=out_bv,
            BKG=key_block,
            **common,
        ),  # fmt: skip
        "state_bwd": _launch(
            chunk_state_bwd_kernel,
            flags,
            state_warps,
            state_bwd_stages,
            BK=BK,
            BV=state_bv,
            BKG=key_block,
            **common,
        ),  # fmt: skip
        "grad": _launch(chunk_grad_kernel, flags, 4, 1, BK=grad_bk, BV=16, **common),
    }


def _chunk(a: DeltaArgs) -> int:
    """Steps per chunk: KEY_CHUNK with a decay per key channel, else CHUNK."""
    return KEY_CHUNK if a.g is not None and a.g.dim() == 4 else CHUNK


def _flags(a: DeltaArgs) -> dict[str, bool]:
    """The gate and recall-key flags of a call."""
    per_key = a.g is not None and a.g.dim() == 4
    return dict(USE_G=a.g is not None and not per_key, USE_GK=per_key, USE_P=a.p is not None)


def _empty(like: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An unfilled buffer on `like`'s device (in its dtype by default). Every buffer the host
    code allocates goes through torch.empty / torch.empty_like, so that a test can make them
    start as NaN and catch a kernel that reads what nothing wrote."""
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def empty_saved(a: DeltaArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's saved buffers (u rows, chunk start states, chunk inverses), unfilled.

    u (B, H, T, V) and, for the chunked kernels, h (B, H, NT, K, V) in float32, and A
    (B, H, NT, C, C) in float32 for float32 inputs, else in the inputs' dtype (it only ever
    enters tl.dot as a half-precision operand). The recurrent kernel saves u only; the other
    two are then empty placeholders.
    """
    q, v, kernel = a.q, a.v, a.kernel
    B, T, H, K = q.shape
    V = v.shape[-1]
    f32 = torch.float32
    u = _empty(q, B, H, T, V, dtype=f32)
    if kernel == "recurrent":
        return u, _empty(q, 0, dtype=f32), _empty(q, 0, dtype=f32)
    C = _chunk(a)
    NT = triton.cdiv(T, C)
    a_dtype = f32 if q.dtype == f32 else q.dtype
    return u, _empty(q, B, H, NT, K, V, dtype=f32), _empty(q, B, H, NT, C, C, dtype=a_dtype)


def _contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.contiguous()


def forward(a: DeltaArgs) -> tuple[torch.Tensor, ...]:
    """o (B, T, H, V) in q's dtype, the final state (B, H, K, V) float32 or None, and the
    buffers the backward needs (see `empty_saved`)."""
    q, k, v, beta = (t.contiguous() for t in (a.q, a.k, a.v, a.beta))
    p, g, init = _contiguous(a.p), _contiguous(a.g), _contiguous(a.initial_state)
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = _empty(q, B, T, H, V)
    final = _empty(q, B, H, K, V, dtype=torch.float32) if a.output_final_state else None
    saved = empty_saved(a._replace(q=q, v=v))
    if B == 0:
        return o, final, *saved
    u, h, A = saved
    # Absent optional tensors: any valid pointer, never read (the flags are compile-time).
    init_arg = init if init is not None else o
    final_arg = final if final is not None else o
    g_arg = g if g is not None else u
    p_arg = p if p is not None else k
    flags = dict(HAS_INIT=init is not None, STORE_FINAL=final is not None, **_flags(a))
    if (
        a.kernel == "recurrent"
    ):  # the delta rule's alone (mecheval_kernels.delta_rule.op.kernel_for)
        launch = recurrent_launches(K, V, B * H, **flags)["forward"]
        launch((triton.cdiv(V, launch.constants["BV"]), B * H),
               q, k, v, beta, init_arg, o, u, final_arg, a.scale, T, H, K, V)  # fmt: skip
        return o, final, *saved
    NT = triton.cdiv(T, _chunk(a))
    launches = chunked_launches(K, V, q.dtype, B * H, **flags)
    launches["inverse"]((NT, B * H), k, p_arg, g_arg, beta, A, T, H, K, NT)
    launch = launches["state_fwd"]
    launch((triton.cdiv(V, launch.constants["BV"]), B * H),
           k, v, p_arg, g_arg, beta, A, init_arg, h, u, final_arg, T, H, K, V, NT)  # fmt: skip
    launch = launches["output"]
    launch((triton.cdiv(V, launch.constants["BV"]), NT, B * H),
           q, k, g_arg, h, u, o, a.scale, T, H, K, V, NT)  # fmt: skip
    return o, final, *saved


def backward(a: DeltaArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (dq, dk, dv, dp, dg, dbeta, dinitial_state), None for an absent p, g or
    initial_state; dg and dbeta in float32."""
    q, k, v, beta, do = (t.contiguous() for t in (a.q, a.k, a.v, a.beta, grads[0]))
    p, g, init = _contiguous(a.p), _contiguous(a.g), _contiguous(a.initial_state)
    dfinal = grads[1].contiguous() if a.output_final_state else None
    B, T, H, K = q.shape
    V = v.shape[-1]
    u, h, A = saved
    f32 = torch.float32
    dv = torch.empty_like(v)
    dinit = None if init is None else _empty(q, B, H, K, V, dtype=f32)
    if B == 0:
        zeros = torch.zeros_like
        dg = None if g is None else zeros(g, dtype=f32)
        dp = None if p is None else zeros(p)
        return [zeros(q), zeros(k), dv, dp, dg, zeros(beta, dtype=f32), dinit]
    dinit_arg = dinit if dinit is not None else dv
    dfinal_arg = dfinal if dfinal is not None else dv
    flags = dict(HAS_INIT=init is not None, HAS_DFINAL=dfinal is not None,
                 STORE_DINIT=dinit is not None, **_flags(a))  # fmt: skip
    if a.kernel == "recurrent":
        launch = recurrent_launches(K, V, B * H, **flags)["backward"]
        NV = triton.cdiv(V, launch.constants["BV"])
        dq_part = _empty(q, NV, B, T, H, K, dtype=f32)
        dk_part = _empty(q, NV, B, T, H, K, dtype=f32)
        dbeta_part = _empty(q, NV, B, T, H, dtype=f32)
        du = _empty(q, B, H, T, V, dtype=f32)
        launch((NV, B * H), q, k, v, beta, init if init is not None else dv, u, do, dfinal_arg,
               du, dq_part, dk_part, dv, dbeta_part, dinit_arg, a.scale, B, T, H, K, V)  # fmt: skip
        # Fixed-order sums over the V blocks: deterministic.
        return [dq_part.sum(0), dk_part.sum(0), dv, None, None, dbeta_part.sum(0), dinit]
    NT = triton.cdiv(T, _chunk(a))
    dh = torch.empty_like(h)
    dr = torch.empty_like(u)
    launches = chunked_launches(K, V, q.dtype, B * H, **flags)
    g_arg = g if g is not None else u
    p_arg = p if p is not None else k
    launch = launches["state_bwd"]
    launch((triton.cdiv(V, launch.constants["BV"]), B * H),
           q, k, p_arg, g_arg, beta, A, do, dfinal_arg, dh, dr, dinit_arg, a.scale, T, H, K, V,
           NT)  # fmt: skip
    launch = launches["grad"]
    NK = triton.cdiv(K, launch.constants["BK"])
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dp = None if p is None else torch.empty_like(p)
    dbeta_part = _empty(q, NK, B, T, H, dtype=f32)
    # A decay per key channel: each K block writes its channels of dg; one per head: its part.
    per_key = flags["USE_GK"]
    dg_part = None if g is None else _empty(q, *((B, T, H, K) if per_key else (NK, B, T, H)),
                                            dtype=f32)  # fmt: skip
    launch((NK, NT, B * H), q, k, v, p_arg, g_arg, beta, h, dh, u, dr, do, dq, dk, dv,
           dq if dp is None else dp, dbeta_part, dbeta_part if dg_part is None else dg_part,
           a.scale, B, T, H, K, V, NT)  # fmt: skip
    # Fixed-order sums over the K blocks: deterministic.
    dg = dg_part if dg_part is None or per_key else dg_part.sum(0)
    return [dq, dk, dv, dp, dg, dbeta_part.sum(0), dinit]


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
        "du_ptr",
        "dq_part_ptr",
        "dk_part_ptr",
        "dbeta_part_ptr",
        "dg_part_ptr",
    }
)


def hopper_specialisations(
    gated: bool = False, per_key: bool = False, recall_key: bool = False
) -> list:
    """The launch configurations to compile-check for sm_90 (see mecheval_kernels.compile_check):
    every kernel of the delta rule (or, `gated`, of the gated delta rule: the chunked ones with
    USE_G; `per_key`, KDA's, with USE_GK; `recall_key` with `gated`, Comba's, with USE_P) as the
    host code launches it, at the benchmark's head size in bf16, a padded head (K=100, V=36) in
    fp16 and the largest head in fp32 (the most shared memory). None may use wgmma (see
    common.CHUNK)."""
    from mecheval_kernels.compile_check import Specialisation

    flags = dict(HAS_INIT=True, STORE_FINAL=True, HAS_DFINAL=True, STORE_DINIT=True,
                 USE_G=gated, USE_GK=per_key, USE_P=recall_key)  # fmt: skip
    specs = []
    for K, V, dtype in (
        (128, 128, torch.bfloat16),
        (100, 36, torch.float16),
        (256, 256, torch.float32),
    ):
        launches = chunked_launches(K, V, dtype, 64, **flags)
        if not (gated or per_key):
            recurrent = recurrent_launches(K, V, 64, **flags)
            launches.update({f"recurrent_{n}": x for n, x in recurrent.items()})
        for launch in launches.values():
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
