"""Triton forward of the selective scan, and the program layout and loads it shares with the
backward.

Grid: one program per (block of BLOCK_D channels, batch row). Channels are split into
"segments" that each lie inside one group of B and one group of C (for grouped layouts), so a
program reads one B group and one C group. Each program holds its float32 state
(BLOCK_D, N_PAD) on chip and walks the sequence in chunks of CHUNK positions. Per chunk it loads
(BLOCK_D, CHUNK) tiles of u, delta (and z) and (N_PAD, CHUNK) tiles of B and C, forms the decays
a = exp(dt A) and inputs b = dt B u as (BLOCK_D, N_PAD, CHUNK) tiles, and solves
h_t = a_t h_{t-1} + b_t with `tl.associative_scan` over the chunk, the incoming state folded into
the first position. Exponentials use exp2 with A pre-scaled by log2(e); A <= 0 never overflows.

The forward writes out, the last state and the state at the start of every chunk (the
checkpoints, float32 (K, B, D, N)), which the backward starts from (see backward.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

# exp(x) = exp2(x * LOG2E): A is scaled once per program, exp2 is the hardware instruction.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def linear_combine(a1, b1, a2, b2):
    # Composition of x -> a1 x + b1 then x -> a2 x + b2 (first argument: earlier in scan order).
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _softplus(x):
    # log(1 + exp(x)), and x itself above 20 where the two agree in float32 (as mamba-ssm).
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)


@triton.jit
def load_bc(ptr, offs_d, mask_d, offs_n, mask_n, t, mask_t, s0, s1, VAR: tl.constexpr):
    """B or C, broadcastable to (BLOCK_D, N_PAD, CHUNK), as float32.

    VAR: `ptr` already points at this batch row and group, strides (s0, s1) = (n, l);
    fixed (D, N): strides (s0, s1) = (d, n).
    """
    if VAR:
        vals = tl.load(
            ptr + offs_n[:, None] * s0 + t[None, :] * s1,
            mask=mask_n[:, None] & mask_t[None, :],
            other=0.0,
        ).to(tl.float32)
        full = vals[None, :, :]
    else:
        vals = tl.load(
            ptr + offs_d[:, None] * s0 + offs_n[None, :] * s1,
            mask=mask_d[:, None] & mask_n[None, :],
            other=0.0,
        ).to(tl.float32)
        full = vals[:, :, None]
    return full


@triton.jit
def load_tile(ptr, offs_d, mask_d, t, mask_t, stride_d, stride_l):
    """A (BLOCK_D, CHUNK) tile of a (D, L) row block as float32, zero off the edges."""
    return tl.load(
        ptr + offs_d[:, None] * stride_d + t[None, :] * stride_l,
        mask=mask_d[:, None] & mask_t[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def load_dt(delta_ptr, bias, offs_d, mask_d, t, mask_t, stride_d, stride_l, SOFTPLUS: tl.constexpr):
    """(dt, pre): pre = delta + bias and dt = softplus(pre) or pre, (BLOCK_D, CHUNK) float32.

    dt is 0 off the end, so steps there leave the state unchanged (a = 1, b = 0).
    """
    pre = load_tile(delta_ptr, offs_d, mask_d, t, mask_t, stride_d, stride_l) + bias[:, None]
    dt = pre
    if SOFTPLUS:
        dt = _softplus(pre)
    dt = tl.where(mask_d[:, None] & mask_t[None, :], dt, 0.0)
    return dt, pre


@triton.jit
def program_setup(
    A_ptr, Dv_ptr, bias_ptr, B_ptr, C_ptr, u_ptr, delta_ptr, z_ptr, ckpt_ptr,
    D, N, SEG, BLOCKS_PER_SEG, D_PER_GB, D_PER_GC, stride_Ad, stride_An, stride_Dv, stride_bias,
    stride_Bb, stride_Bg, stride_Cb, stride_Cg, stride_ub, stride_db, stride_zb,
    B_VAR: tl.constexpr, C_VAR: tl.constexpr, HAS_D: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr,
):  # fmt: skip
    """What both passes set up per program: its batch row, channels (offs_d, mask_d) and states
    (offs_n, mask_n, mask_dn), A and A * log2(e), D and delta_bias of its channels as float32 (zeros
    where absent), the B, C, u, delta and z pointers moved to its batch row (and B's and C's
    group, when time-dependent), and where its chunk checkpoints (K, B, D, N) lie: chunk c at
    ckpt_rows + c * ckpt_step."""
    pid = tl.program_id(0)
    seg = pid // BLOCKS_PER_SEG
    in_seg = (pid % BLOCKS_PER_SEG) * BLOCK_D + tl.arange(0, BLOCK_D)
    pid_b = tl.program_id(1).to(tl.int64)
    offs_d, mask_d = seg * SEG + in_seg, in_seg < SEG
    offs_n = tl.arange(0, N_PAD)
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = tl.load(
        A_ptr + offs_d[:, None] * stride_Ad + offs_n[None, :] * stride_An, mask=mask_dn, other=0.0
    ).to(tl.float32)
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d * stride_bias, mask=mask_d, other=0.0).to(tl.float32)
    Dv = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_D:
        Dv = tl.load(Dv_ptr + offs_d * stride_Dv, mask=mask_d, other=0.0).to(tl.float32)
    if B_VAR:
        B_ptr += pid_b * stride_Bb + ((seg * SEG) // D_PER_GB) * stride_Bg
    if C_VAR:
        C_ptr += pid_b * stride_Cb + ((seg * SEG) // D_PER_GC) * stride_Cg
    ckpt_rows = ckpt_ptr + (pid_b * D + offs_d[:, None]) * N + offs_n[None, :]
    ckpt_step = tl.num_programs(1).to(tl.int64) * D * N
    return (
        pid_b, offs_d, mask_d, offs_n, mask_n, mask_dn, A, A * LOG2E, Dv, bias, B_ptr, C_ptr,
        u_ptr + pid_b * stride_ub, delta_ptr + pid_b * stride_db, z_ptr + pid_b * stride_zb,
        ckpt_rows, ckpt_step,
    )  # fmt: skip


@triton.jit
def load_state(
    ptr, pid_b, offs_d, offs_n, mask_dn, stride_b, stride_d, stride_n,
    PRESENT: tl.constexpr, BLOCK_D: tl.constexpr, N_PAD: tl.constexpr,
):  # fmt: skip
    """This program's (BLOCK_D, N_PAD) float32 tile of a (B, D, N) state (an initial state or a
    gradient), or zeros when it is absent."""
    state = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    if PRESENT:
        rows = ptr + pid_b * stride_b + offs_d[:, None] * stride_d + offs_n[None, :] * stride_n
        state = tl.load(rows, mask=mask_dn, other=0.0).to(tl.float32)
    return state


@triton.jit
def scan_fwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, Dv_ptr, z_ptr, bias_ptr,
    D, N, L, NUM_CHUNKS, SEG, BLOCKS_PER_SEG, D_PER_GB, D_PER_GC,
    stride_ub, stride_ud, stride_ul, stride_db, stride_dd, stride_dl, stride_Ad, stride_An,
    stride_Bb, stride_Bg, stride_B0, stride_B1, stride_Cb, stride_Cg, stride_C0, stride_C1,
    stride_Dv, stride_zb, stride_zd, stride_zl, stride_bias,
    init_ptr, out_ptr, last_ptr, ckpt_ptr,
    stride_ib, stride_id, stride_in, stride_ob, stride_od, stride_ol,
    B_VAR: tl.constexpr, C_VAR: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    (pid_b, offs_d, mask_d, offs_n, mask_n, mask_dn, A, A2, Dv, bias, B_ptr, C_ptr, u_ptr,
     delta_ptr, z_ptr, ckpt_rows, ckpt_step) = program_setup(
        A_ptr, Dv_ptr, bias_ptr, B_ptr, C_ptr, u_ptr, delta_ptr, z_ptr, ckpt_ptr, D, N, SEG,
        BLOCKS_PER_SEG, D_PER_GB, D_PER_GC, stride_Ad, stride_An, stride_Dv, stride_bias,
        stride_Bb, stride_Bg, stride_Cb, stride_Cg, stride_ub, stride_db, stride_zb, B_VAR, C_VAR,
        HAS_D, HAS_BIAS, BLOCK_D, N_PAD,
    )  # fmt: skip
    out_ptr += pid_b * stride_ob
    offs_k = tl.arange(0, CHUNK)

    h = load_state(
        init_ptr, pid_b, offs_d, offs_n, mask_dn, stride_ib, stride_id, stride_in, HAS_INIT,
        BLOCK_D, N_PAD,
    )  # fmt: skip

    for c in range(0, NUM_CHUNKS):
        t = c * CHUNK + offs_k
        mask_t = t < L
        tl.store(ckpt_rows + c * ckpt_step, h, mask=mask_dn)
        u = load_tile(u_ptr, offs_d, mask_d, t, mask_t, stride_ud, stride_ul)
        dt, _ = load_dt(delta_ptr, bias, offs_d, mask_d, t, mask_t, stride_dd, stride_dl, SOFTPLUS)
        Bt = load_bc(B_ptr, offs_d, mask_d, offs_n, mask_n, t, mask_t, stride_B0, stride_B1, B_VAR)
        Ct = load_bc(C_ptr, offs_d, mask_d, offs_n, mask_n, t, mask_t, stride_C0, stride_C1, C_VAR)
        a = tl.exp2(dt[:, None, :] * A2[:, :, None])
        b = (dt * u)[:, None, :] * Bt
        b += tl.where(offs_k[None, None, :] == 0, a * h[:, :, None], 0.0)
        _, hs = tl.associative_scan((a, b), 2, linear_combine)
        h = tl.sum(tl.where(offs_k[None, None, :] == CHUNK - 1, hs, 0.0), axis=2)

        y = tl.sum(hs * Ct, axis=1)
        if HAS_D:
            y += Dv[:, None] * u
        mask = mask_d[:, None] & mask_t[None, :]
        if HAS_Z:
            z = load_tile(z_ptr, offs_d, mask_d, t, mask_t, stride_zd, stride_zl)
            y = y * z * tl.sigmoid(z)
        tl.store(
            out_ptr + offs_d[:, None] * stride_od + t[None, :] * stride_ol,
            y.to(out_ptr.dtype.element_ty),
            mask=mask,
        )

    tl.store(last_ptr + (pid_b * D + offs_d[:, None]) * N + offs_n[None, :], h, mask=mask_dn)
