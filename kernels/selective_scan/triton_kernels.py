"""Triton forward and backward of the selective scan.

Grid: one program per (block of BLOCK_D channels, batch row). Channels are split into
"segments" that each lie inside one group of B and one group of C (for grouped layouts), so a
program reads one B group and one C group. Each program holds its float32 state
(BLOCK_D, N_PAD) on chip and walks the sequence in chunks of CHUNK positions. Per chunk it loads
(BLOCK_D, CHUNK) tiles of u, delta (and z) and (N_PAD, CHUNK) tiles of B and C, forms the decays
a = exp(dt A) and inputs b = dt B u as (BLOCK_D, N_PAD, CHUNK) tiles, and solves
h_t = a_t h_{t-1} + b_t with `tl.associative_scan` over the chunk, the incoming state folded into
the first position. Exponentials use exp2 with A pre-scaled by log2(e); A <= 0 never overflows.

The forward writes out, the last state and the state at the start of every chunk (the
checkpoints, float32 (K, B, D, N)). The backward walks the chunks in reverse: it recomputes the
states before each position, h_{t-1}, from the chunk's checkpoint (a scan over the steps one
position earlier, started from the checkpoint), then h_t = a_t h_{t-1} + b_t, and runs the
adjoint recurrence dh_t = g_t C_t + exp(dt_{t+1} A) dh_{t+1} as a reverse associative scan, the
adjoint carried in from the later chunk added at the chunk's last position. With
P = dh_t a_t h_{t-1} every gradient is a sum of products of on-chip tiles. P is formed from
h_{t-1} itself, not as dh_t (h_t - b_t): that difference is rounding noise where a_t h_{t-1}
is 0 or tiny (no initial state, or a decay that underflows), and on a GPU, where the compiler
fuses it into an FMA, the noise is not even 0 where h_{t-1} is.

Determinism: no atomics. Sums over positions (dA, dD, d(delta_bias), a fixed B's or C's
gradient) are accumulated in registers by one program in a fixed order and written per
(batch row, channel); sums over channels (a time-dependent B's or C's gradient) are written per
program as (N, L) partials. The host reduces the partials with torch.sum, in a fixed order.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.layout import match_layout

# exp(x) = exp2(x * LOG2E): A is scaled once per program, exp2 is the hardware instruction.
LOG2E = tl.constexpr(1.4426950408889634)
# Launch configuration, chosen without a GPU to measure: to be tuned on one (they are plain
# module constants for that). At N = 16 the tile is 16 channels x 16 states x 16 positions;
# compiled for sm_90 (Triton 3.9, ptxas -v), every option on, the forward then needs 196
# registers at 4 warps and the backward 234 at 8 warps (at most 254 over the combinations of
# options), with no spills (at 4 warps the backward spills). At N = 32 a few combinations
# spill a few bytes in the backward.
TILE_ELEMENTS = 4096  # elements of one (BLOCK_D, N_PAD, CHUNK) register tile
MAX_CHUNK = 16  # positions per chunk (and between checkpoints)
FORWARD_WARPS = 4
BACKWARD_WARPS = 8


@triton.jit
def _linear_combine(a1, b1, a2, b2):
    # Composition of x -> a1 x + b1 then x -> a2 x + b2 (first argument: earlier in scan order).
    return a1 * a2, a2 * b1 + b2


@triton.jit
def _softplus(x):
    # log(1 + exp(x)), and x itself above 20 where the two agree in float32 (as mamba-ssm).
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))), x)


@triton.jit
def _load_bc(
    ptr,
    offs_d,
    mask_d,
    offs_n,
    mask_n,
    t,
    mask_t,
    s0,
    s1,
    VAR: tl.constexpr,
):
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
def _load_tile(ptr, offs_d, mask_d, t, mask_t, stride_d, stride_l):
    """A (BLOCK_D, CHUNK) tile of a (D, L) row block as float32, zero off the edges."""
    return tl.load(
        ptr + offs_d[:, None] * stride_d + t[None, :] * stride_l,
        mask=mask_d[:, None] & mask_t[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _load_dt(
    delta_ptr, bias, offs_d, mask_d, t, mask_t, stride_d, stride_l, SOFTPLUS: tl.constexpr
):
    """(dt, pre): pre = delta + bias and dt = softplus(pre) or pre, (BLOCK_D, CHUNK) float32.

    dt is 0 off the end, so steps there leave the state unchanged (a = 1, b = 0).
    """
    pre = _load_tile(delta_ptr, offs_d, mask_d, t, mask_t, stride_d, stride_l) + bias[:, None]
    dt = pre
    if SOFTPLUS:
        dt = _softplus(pre)
    dt = tl.where(mask_d[:, None] & mask_t[None, :], dt, 0.0)
    return dt, pre


@triton.jit
def _scan_fwd_kernel(
    u_ptr,
    delta_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    Dv_ptr,
    z_ptr,
    bias_ptr,
    init_ptr,
    out_ptr,
    last_ptr,
    ckpt_ptr,
    D,
    N,
    L,
    NUM_CHUNKS,
    SEG,
    BLOCKS_PER_SEG,
    D_PER_GB,
    D_PER_GC,
    stride_ub,
    stride_ud,
    stride_ul,
    stride_db,
    stride_dd,
    stride_dl,
    stride_Ad,
    stride_An,
    stride_Bb,
    stride_Bg,
    stride_B0,
    stride_B1,
    stride_Cb,
    stride_Cg,
    stride_C0,
    stride_C1,
    stride_Dv,
    stride_zb,
    stride_zd,
    stride_zl,
    stride_bias,
    stride_ib,
    stride_id,
    stride_in,
    stride_ob,
    stride_od,
    stride_ol,
    B_VAR: tl.constexpr,
    C_VAR: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    seg = pid // BLOCKS_PER_SEG
    in_seg = (pid % BLOCKS_PER_SEG) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = in_seg < SEG
    offs_d = seg * SEG + in_seg
    offs_n = tl.arange(0, N_PAD)
    mask_n = offs_n < N
    offs_k = tl.arange(0, CHUNK)
    mask_dn = mask_d[:, None] & mask_n[None, :]

    A2 = (
        tl.load(
            A_ptr + offs_d[:, None] * stride_Ad + offs_n[None, :] * stride_An,
            mask=mask_dn,
            other=0.0,
        ).to(tl.float32)
        * LOG2E
    )
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d * stride_bias, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(Dv_ptr + offs_d * stride_Dv, mask=mask_d, other=0.0).to(tl.float32)
    if B_VAR:
        B_ptr += pid_b * stride_Bb + ((seg * SEG) // D_PER_GB) * stride_Bg
    if C_VAR:
        C_ptr += pid_b * stride_Cb + ((seg * SEG) // D_PER_GC) * stride_Cg
    u_ptr += pid_b * stride_ub
    delta_ptr += pid_b * stride_db
    z_ptr += pid_b * stride_zb
    out_ptr += pid_b * stride_ob
    # Checkpoints (K, B, D, N): chunk c of this program's rows at ckpt_rows + c * B * D * N.
    ckpt_rows = ckpt_ptr + (pid_b * D + offs_d[:, None]) * N + offs_n[None, :]
    ckpt_step = tl.num_programs(1).to(tl.int64) * D * N

    h = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    if HAS_INIT:
        h = tl.load(
            init_ptr
            + pid_b * stride_ib
            + offs_d[:, None] * stride_id
            + offs_n[None, :] * stride_in,
            mask=mask_dn,
            other=0.0,
        ).to(tl.float32)

    for c in range(0, NUM_CHUNKS):
        t = c * CHUNK + offs_k
        mask_t = t < L
        tl.store(ckpt_rows + c * ckpt_step, h, mask=mask_dn)
        u = _load_tile(u_ptr, offs_d, mask_d, t, mask_t, stride_ud, stride_ul)
        dt, _ = _load_dt(delta_ptr, bias, offs_d, mask_d, t, mask_t, stride_dd, stride_dl, SOFTPLUS)
        Bt = _load_bc(B_ptr, offs_d, mask_d, offs_n, mask_n, t, mask_t, stride_B0, stride_B1, B_VAR)
        Ct = _load_bc(C_ptr, offs_d, mask_d, offs_n, mask_n, t, mask_t, stride_C0, stride_C1, C_VAR)
        a = tl.exp2(dt[:, None, :] * A2[:, :, None])
        b = (dt * u)[:, None, :] * Bt
        b += tl.where(offs_k[None, None, :] == 0, a * h[:, :, None], 0.0)
        _, hs = tl.associative_scan((a, b), 2, _linear_combine)
        h = tl.sum(tl.where(offs_k[None, None, :] == CHUNK - 1, hs, 0.0), axis=2)

        y = tl.sum(hs * Ct, axis=1)
        if HAS_D:
            y += Dv[:, None] * u
        mask = mask_d[:, None] & mask_t[None, :]
        if HAS_Z:
            z = _load_tile(z_ptr, offs_d, mask_d, t, mask_t, stride_zd, stride_zl)
            y = y * z * tl.sigmoid(z)
        tl.store(
            out_ptr + offs_d[:, None] * stride_od + t[None, :] * stride_ol,
            y.to(out_ptr.dtype.element_ty),
            mask=mask,
        )

    tl.store(last_ptr + (pid_b * D + offs_d[:, None]) * N + offs_n[None, :], h, mask=mask_dn)


@triton.jit
def _scan_bwd_kernel(
    u_ptr,
    delta_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    Dv_ptr,
    z_ptr,
    bias_ptr,
    ckpt_ptr,
    dout_ptr,
    dlast_ptr,
    du_ptr,
    ddelta_ptr,
    dz_ptr,
    dinit_ptr,
    dA_part_ptr,
    dD_part_ptr,
    dbias_part_ptr,
    dB_part_ptr,
    dC_part_ptr,
    D,
    N,
    L,
    NUM_CHUNKS,
    SEG,
    BLOCKS_PER_SEG,
    D_PER_GB,
    D_PER_GC,
    stride_ub,
    stride_ud,
    stride_ul,
    stride_db,
    stride_dd,
    stride_dl,
    stride_Ad,
    stride_An,
    stride_Bb,
    stride_Bg,
    stride_B0,
    stride_B1,
    stride_Cb,
    stride_Cg,
    stride_C0,
    stride_C1,
    stride_Dv,
    stride_zb,
    stride_zd,
    stride_zl,
    stride_bias,
    stride_gb,
    stride_gd,
    stride_gl,
    stride_lb,
    stride_ld,
    stride_ln,
    stride_dub,
    stride_dud,
    stride_dul,
    stride_ddb,
    stride_ddd,
    stride_ddl,
    stride_dzb,
    stride_dzd,
    stride_dzl,
    B_VAR: tl.constexpr,
    C_VAR: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_DLAST: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    N_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_b = tl.program_id(1).to(tl.int64)
    num_programs = tl.num_programs(0)
    seg = pid // BLOCKS_PER_SEG
    in_seg = (pid % BLOCKS_PER_SEG) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = in_seg < SEG
    offs_d = seg * SEG + in_seg
    offs_n = tl.arange(0, N_PAD)
    mask_n = offs_n < N
    offs_k = tl.arange(0, CHUNK)
    mask_dn = mask_d[:, None] & mask_n[None, :]

    A = tl.load(
        A_ptr + offs_d[:, None] * stride_Ad + offs_n[None, :] * stride_An, mask=mask_dn, other=0.0
    ).to(tl.float32)
    A2 = A * LOG2E
    bias = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_d * stride_bias, mask=mask_d, other=0.0).to(tl.float32)
    if HAS_D:
        Dv = tl.load(Dv_ptr + offs_d * stride_Dv, mask=mask_d, other=0.0).to(tl.float32)
    if B_VAR:
        B_ptr += pid_b * stride_Bb + ((seg * SEG) // D_PER_GB) * stride_Bg
    if C_VAR:
        C_ptr += pid_b * stride_Cb + ((seg * SEG) // D_PER_GC) * stride_Cg
    u_ptr += pid_b * stride_ub
    delta_ptr += pid_b * stride_db
    z_ptr += pid_b * stride_zb
    dout_ptr += pid_b * stride_gb
    du_ptr += pid_b * stride_dub
    ddelta_ptr += pid_b * stride_ddb
    dz_ptr += pid_b * stride_dzb
    # Checkpoints (K, B, D, N): chunk c of this program's rows at ckpt_rows + c * B * D * N.
    ckpt_rows = ckpt_ptr + (pid_b * D + offs_d[:, None]) * N + offs_n[None, :]
    ckpt_step = tl.num_programs(1).to(tl.int64) * D * N
    # This program's (N, L) partials of a time-dependent B's and C's gradient.
    part_rows = (pid_b * num_programs + pid) * N * L + offs_n[:, None] * L

    # The adjoint of the state after the chunk being processed; the last state's gradient first.
    carry = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    if HAS_DLAST:
        carry = tl.load(
            dlast_ptr
            + pid_b * stride_lb
            + offs_d[:, None] * stride_ld
            + offs_n[None, :] * stride_ln,
            mask=mask_dn,
            other=0.0,
        ).to(tl.float32)
    dA_acc = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    dB_acc = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    dC_acc = tl.zeros((BLOCK_D, N_PAD), dtype=tl.float32)
    dD_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    dbias_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)

    for i in range(0, NUM_CHUNKS):
        c = NUM_CHUNKS - 1 - i
        t = c * CHUNK + offs_k
        mask_t = t < L
        mask = mask_d[:, None] & mask_t[None, :]
        u = _load_tile(u_ptr, offs_d, mask_d, t, mask_t, stride_ud, stride_ul)
        dt, pre = _load_dt(
            delta_ptr, bias, offs_d, mask_d, t, mask_t, stride_dd, stride_dl, SOFTPLUS
        )
        Bt = _load_bc(B_ptr, offs_d, mask_d, offs_n, mask_n, t, mask_t, stride_B0, stride_B1, B_VAR)
        Ct = _load_bc(C_ptr, offs_d, mask_d, offs_n, mask_n, t, mask_t, stride_C0, stride_C1, C_VAR)

        # The state before each position, h_{t-1}, recomputed from the chunk's checkpoint h0 by
        # a scan over the steps one position earlier (step t - 1 at position t); at position 0
        # the step is (1, h0), so the scan starts from h0 itself. Then a_t h_{t-1} is exactly
        # 0 where h_{t-1} is (h_t - b_t would leave the rounding error of b_t).
        first = offs_k[None, None, :] == 0
        h0 = tl.load(ckpt_rows + c * ckpt_step, mask=mask_dn, other=0.0)
        mask_p = (offs_k > 0) & (t - 1 < L)
        dt_p, _ = _load_dt(
            delta_ptr, bias, offs_d, mask_d, t - 1, mask_p, stride_dd, stride_dl, SOFTPLUS
        )
        u_p = _load_tile(u_ptr, offs_d, mask_d, t - 1, mask_p, stride_ud, stride_ul)
        B_p = Bt
        if B_VAR:
            B_p = _load_bc(
                B_ptr, offs_d, mask_d, offs_n, mask_n, t - 1, mask_p, stride_B0, stride_B1, True
            )
        b_p = (dt_p * u_p)[:, None, :] * B_p + tl.where(first, h0[:, :, None], 0.0)
        _, h_prev = tl.associative_scan(
            (tl.exp2(dt_p[:, None, :] * A2[:, :, None]), b_p), 2, _linear_combine
        )
        a = tl.exp2(dt[:, None, :] * A2[:, :, None])
        a_first = tl.sum(tl.where(first, a, 0.0), axis=2)
        decayed = a * h_prev  # a_t h_{t-1}
        hs = decayed + (dt * u)[:, None, :] * Bt  # h_t

        g = _load_tile(dout_ptr, offs_d, mask_d, t, mask_t, stride_gd, stride_gl)
        if HAS_Z:
            z = _load_tile(z_ptr, offs_d, mask_d, t, mask_t, stride_zd, stride_zl)
            sig_z = tl.sigmoid(z)
            gated = tl.sum(hs * Ct, axis=1)
            if HAS_D:
                gated += Dv[:, None] * u
            dz = g * gated * sig_z * (1.0 + z * (1.0 - sig_z))
            tl.store(
                dz_ptr + offs_d[:, None] * stride_dzd + t[None, :] * stride_dzl,
                dz.to(dz_ptr.dtype.element_ty),
                mask=mask,
            )
            g = g * z * sig_z
        if HAS_D:
            dD_acc += tl.sum(g * u, axis=1)
        # C's gradient now, so that the states need not live through the adjoint's scan.
        mask_nt = mask_n[:, None] & mask_t[None, :]
        dC = hs * g[:, None, :]
        if C_VAR:
            tl.store(dC_part_ptr + part_rows + t[None, :], tl.sum(dC, axis=0), mask=mask_nt)
        else:
            dC_acc += tl.sum(dC, axis=2)

        # The adjoint, backwards through the chunk. dt one position later: the decay that
        # carries dh_{t+1} back to dh_t.
        dt_next, _ = _load_dt(
            delta_ptr, bias, offs_d, mask_d, t + 1, t + 1 < L, stride_dd, stride_dl, SOFTPLUS
        )
        a_next = tl.exp2(dt_next[:, None, :] * A2[:, :, None])
        G = g[:, None, :] * Ct + tl.where(
            offs_k[None, None, :] == CHUNK - 1, carry[:, :, None], 0.0
        )
        _, dh = tl.associative_scan((a_next, G), 2, _linear_combine, reverse=True)
        carry = a_first * tl.sum(tl.where(first, dh, 0.0), axis=2)

        P = dh * decayed
        dA_acc += tl.sum(P * dt[:, None, :], axis=2)
        S = tl.sum(dh * Bt, axis=1)  # sum_n dh * B
        du = dt * S
        if HAS_D:
            du += Dv[:, None] * g
        ddt = tl.sum(P * A[:, :, None], axis=1) + u * S
        if SOFTPLUS:
            ddt = ddt * tl.sigmoid(pre)
        ddt = tl.where(mask, ddt, 0.0)
        dbias_acc += tl.sum(ddt, axis=1)
        tl.store(
            du_ptr + offs_d[:, None] * stride_dud + t[None, :] * stride_dul,
            du.to(du_ptr.dtype.element_ty),
            mask=mask,
        )
        tl.store(
            ddelta_ptr + offs_d[:, None] * stride_ddd + t[None, :] * stride_ddl,
            ddt.to(ddelta_ptr.dtype.element_ty),
            mask=mask,
        )

        dB = dh * (dt * u)[:, None, :]
        if B_VAR:
            tl.store(dB_part_ptr + part_rows + t[None, :], tl.sum(dB, axis=0), mask=mask_nt)
        else:
            dB_acc += tl.sum(dB, axis=2)

    rows_dn = (pid_b * D + offs_d[:, None]) * N + offs_n[None, :]
    if HAS_INIT:
        tl.store(dinit_ptr + rows_dn, carry, mask=mask_dn)
    tl.store(dA_part_ptr + rows_dn, dA_acc, mask=mask_dn)
    if not B_VAR:
        tl.store(dB_part_ptr + rows_dn, dB_acc, mask=mask_dn)
    if not C_VAR:
        tl.store(dC_part_ptr + rows_dn, dC_acc, mask=mask_dn)
    if HAS_D:
        tl.store(dD_part_ptr + pid_b * D + offs_d, dD_acc, mask=mask_d)
    if HAS_BIAS:
        tl.store(dbias_part_ptr + pid_b * D + offs_d, dbias_acc, mask=mask_d)


def _chunk(state: int, length: int) -> int:
    n_pad = max(2, triton.next_power_of_2(state))
    chunk = min(MAX_CHUNK, max(2, triton.next_power_of_2(length)))
    return max(2, min(chunk, TILE_ELEMENTS // (2 * n_pad)))


def num_checkpoints(batch: int, channels: int, state: int, length: int) -> int:
    """Number of chunk-start states the forward saves for the backward."""
    return triton.cdiv(length, _chunk(state, length))


def _groups(X: torch.Tensor) -> int:
    return X.shape[1] if X.dim() == 4 else 1


class _Plan:
    """Block sizes, grid and the B/C pointer strides of one call."""

    def __init__(self, u: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor):
        batch, channels, length = u.shape
        state = A.shape[1]
        self.chunk = _chunk(state, length)
        self.n_pad = max(2, triton.next_power_of_2(state))
        self.num_chunks = triton.cdiv(length, self.chunk)
        # Segments: runs of channels that share one B group and one C group.
        self.gb, self.gc = _groups(B), _groups(C)
        segments = math.lcm(self.gb, self.gc)
        self.seg = channels // segments
        self.block_d = max(
            2,
            min(
                triton.next_power_of_2(self.seg),
                TILE_ELEMENTS // (self.n_pad * self.chunk),
            ),
        )
        self.blocks_per_seg = triton.cdiv(self.seg, self.block_d)
        self.grid = (segments * self.blocks_per_seg, batch)
        self.b_args = self._bc_args(B, channels)
        self.c_args = self._bc_args(C, channels)

    @staticmethod
    def _bc_args(X: torch.Tensor, channels: int) -> tuple[int, ...]:
        """(channels per group, stride of batch, of group, then the two the kernel walks)."""
        if X.dim() == 2:  # (D, N): walked along (d, n)
            return (channels, 0, 0, X.stride(0), X.stride(1))
        if X.dim() == 3:  # (B, N, L): one group
            return (channels, X.stride(0), 0, X.stride(1), X.stride(2))
        return (channels // X.shape[1], X.stride(0), X.stride(1), X.stride(2), X.stride(3))

    def meta(self) -> dict:
        return dict(BLOCK_D=self.block_d, N_PAD=self.n_pad, CHUNK=self.chunk)


def _strides3(t: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if t is None else t.stride()


def forward(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    softplus: bool,
    save_checkpoints: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (B, D, L) in u's dtype and layout, last_state (B, D, N), checkpoints (K, B, D, N));
    K = 0 when not `save_checkpoints` (the kernel writes them regardless)."""
    batch, channels, length = u.shape
    N = A.shape[1]
    plan = _Plan(u, A, B, C)
    f32 = dict(dtype=torch.float32, device=u.device)
    out = torch.empty_like(u)
    last = torch.empty(batch, channels, N, **f32)
    ckpt = torch.empty(plan.num_chunks, batch, channels, N, **f32)
    gb_per, *b_strides = plan.b_args
    gc_per, *c_strides = plan.c_args
    _scan_fwd_kernel[plan.grid](
        u,
        delta,
        A,
        B,
        C,
        D if D is not None else A,
        z if z is not None else u,
        delta_bias if delta_bias is not None else A,
        initial_state if initial_state is not None else last,
        out,
        last,
        ckpt,
        channels,
        N,
        length,
        plan.num_chunks,
        plan.seg,
        plan.blocks_per_seg,
        gb_per,
        gc_per,
        *u.stride(),
        *delta.stride(),
        *A.stride(),
        *b_strides,
        *c_strides,
        D.stride(0) if D is not None else 0,
        *_strides3(z),
        delta_bias.stride(0) if delta_bias is not None else 0,
        *_strides3(initial_state),
        *out.stride(),
        B_VAR=B.dim() > 2,
        C_VAR=C.dim() > 2,
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        HAS_INIT=initial_state is not None,
        SOFTPLUS=softplus,
        **plan.meta(),
        num_warps=FORWARD_WARPS,
    )
    if not save_checkpoints:
        ckpt = ckpt.new_empty(0, *ckpt.shape[1:])
    return out, last, ckpt


def _reduce_bc(part: torch.Tensor, X: torch.Tensor, groups: int) -> torch.Tensor:
    """A B or C gradient from its per-program partials, summed in a fixed order."""
    if X.dim() == 2:  # (batch, D, N) partials
        grad = part.sum(0)
    else:  # (batch, programs, N, L), programs ordered by group
        batch, programs, N, L = part.shape
        grad = part.view(batch, groups, programs // groups, N, L).sum(2)
        if X.dim() == 3:
            grad = grad[:, 0]
    return grad.to(X.dtype)


def backward(
    dout: torch.Tensor,
    dlast: torch.Tensor | None,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    checkpoints: torch.Tensor,
    softplus: bool,
) -> list[torch.Tensor | None]:
    """Gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state), each in its
    input's dtype and layout; None for absent inputs."""
    batch, channels, length = u.shape
    N = A.shape[1]
    plan = _Plan(u, A, B, C)
    programs = plan.grid[0]
    f32 = dict(dtype=torch.float32, device=u.device)
    du = torch.empty_like(u)
    ddelta = torch.empty_like(delta)
    dz = torch.empty_like(z) if z is not None else None
    dinit = torch.empty(batch, channels, N, **f32) if initial_state is not None else None
    dA_part = torch.empty(batch, channels, N, **f32)
    dD_part = torch.empty(batch, channels, **f32) if D is not None else None
    dbias_part = torch.empty(batch, channels, **f32) if delta_bias is not None else None

    def bc_part(X):
        if X.dim() == 2:
            return torch.empty(batch, channels, N, **f32)
        return torch.empty(batch, programs, N, length, **f32)

    dB_part, dC_part = bc_part(B), bc_part(C)
    gb_per, *b_strides = plan.b_args
    gc_per, *c_strides = plan.c_args
    _scan_bwd_kernel[plan.grid](
        u,
        delta,
        A,
        B,
        C,
        D if D is not None else A,
        z if z is not None else u,
        delta_bias if delta_bias is not None else A,
        checkpoints,
        dout,
        dlast if dlast is not None else dA_part,
        du,
        ddelta,
        dz if dz is not None else du,
        dinit if dinit is not None else dA_part,
        dA_part,
        dD_part if dD_part is not None else dA_part,
        dbias_part if dbias_part is not None else dA_part,
        dB_part,
        dC_part,
        channels,
        N,
        length,
        plan.num_chunks,
        plan.seg,
        plan.blocks_per_seg,
        gb_per,
        gc_per,
        *u.stride(),
        *delta.stride(),
        *A.stride(),
        *b_strides,
        *c_strides,
        D.stride(0) if D is not None else 0,
        *_strides3(z),
        delta_bias.stride(0) if delta_bias is not None else 0,
        *dout.stride(),
        *_strides3(dlast),
        *du.stride(),
        *ddelta.stride(),
        *_strides3(dz),
        B_VAR=B.dim() > 2,
        C_VAR=C.dim() > 2,
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=delta_bias is not None,
        HAS_INIT=initial_state is not None,
        HAS_DLAST=dlast is not None,
        SOFTPLUS=softplus,
        **plan.meta(),
        num_warps=BACKWARD_WARPS,
    )

    def reduced(part: torch.Tensor | None, like: torch.Tensor | None):
        """A (batch, ...) partial sum over batch rows, in `like`'s dtype and layout."""
        return None if like is None else match_layout(part.sum(0).to(like.dtype), like)

    return [
        du,
        ddelta,
        reduced(dA_part, A),
        match_layout(_reduce_bc(dB_part, B, plan.gb), B),
        match_layout(_reduce_bc(dC_part, C, plan.gc), C),
        reduced(dD_part, D),
        dz,
        reduced(dbias_part, delta_bias),
        None if dinit is None else match_layout(dinit.to(initial_state.dtype), initial_state),
    ]


# Pointer arguments that are float32 whatever the input dtype (A, D and delta_bias as Mamba
# keeps them, states, checkpoints, partial sums).
FLOAT32_POINTERS = frozenset(
    {
        "A_ptr",
        "Dv_ptr",
        "bias_ptr",
        "init_ptr",
        "last_ptr",
        "ckpt_ptr",
        "dlast_ptr",
        "dinit_ptr",
        "dA_part_ptr",
        "dD_part_ptr",
        "dbias_part_ptr",
        "dB_part_ptr",
        "dC_part_ptr",
    }
)


def hopper_specialisations() -> list:
    """The launch configurations to compile-check for sm_90 (see kernels.compile_check): both
    kernels at the tiles of N = 16, 64 and 256 and the smallest one, every option on, off and
    mixed, all three dtypes."""
    from kernels.compile_check import Specialisation

    options = ("B_VAR", "C_VAR", "HAS_D", "HAS_Z", "HAS_BIAS", "HAS_INIT", "HAS_DLAST", "SOFTPLUS")
    specs = []
    for dtype, (block_d, n_pad, chunk), on in (
        (torch.bfloat16, (16, 16, 16), options),
        (torch.float32, (16, 16, 16), ("HAS_D", "HAS_BIAS", "SOFTPLUS")),
        (torch.float16, (4, 64, 16), ("B_VAR", "HAS_Z", "HAS_INIT", "HAS_DLAST")),
        (torch.float32, (2, 256, 8), options),
        (torch.bfloat16, (2, 2, 2), ()),
    ):
        for kernel, warps in (
            (_scan_fwd_kernel, FORWARD_WARPS),
            (_scan_bwd_kernel, BACKWARD_WARPS),
        ):
            constants = dict(BLOCK_D=block_d, N_PAD=n_pad, CHUNK=chunk)
            constants.update({o: o in on for o in options if o in kernel.arg_names})
            specs.append(
                Specialisation(
                    kernel, constants, dtype, warps=warps, float32_pointers=FLOAT32_POINTERS
                )
            )
    return specs
