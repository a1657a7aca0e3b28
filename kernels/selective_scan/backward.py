"""Triton backward of the selective scan.

It walks the chunks in reverse: it recomputes the states before each position, h_{t-1}, from
the chunk's checkpoint (a scan over the steps one position earlier, started from the
checkpoint), then h_t = a_t h_{t-1} + b_t, and runs the adjoint recurrence
dh_t = g_t C_t + exp(dt_{t+1} A) dh_{t+1} as a reverse associative scan, the adjoint carried in
from the later chunk added at the chunk's last position. With P = dh_t a_t h_{t-1} every
gradient is a sum of products of on-chip tiles. P is formed from h_{t-1} itself, not as
dh_t (h_t - b_t): that difference is rounding noise where a_t h_{t-1} is 0 or tiny (no initial
state, or a decay that underflows), and on a GPU, where the compiler fuses it into an FMA, the
noise is not even 0 where h_{t-1} is.

Determinism: no atomics. Sums over positions (dA, dD, d(delta_bias), a fixed B's or C's
gradient) are accumulated in registers by one program in a fixed order and written per
(batch row, channel); sums over channels (a time-dependent B's or C's gradient) are written per
program as (N, L) partials. The host reduces the partials with torch.sum, in a fixed order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mecheval_kernels.selective_scan.forward import (
    linear_combine,
    load_bc,
    load_dt,
    load_state,
    load_tile,
    program_setup,
)


@triton.jit
def scan_bwd_kernel(
    u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, Dv_ptr, z_ptr, bias_ptr,
    D, N, L, NUM_CHUNKS, SEG, BLOCKS_PER_SEG, D_PER_GB, D_PER_GC,
    stride_ub, stride_ud, stride_ul, stride_db, stride_dd, stride_dl, stride_Ad, stride_An,
    stride_Bb, stride_Bg, stride_B0, stride_B1, stride_Cb, stride_Cg, stride_C0, stride_C1,
    stride_Dv, stride_zb, stride_zd, stride_zl, stride_bias,
    ckpt_ptr, dout_ptr, dlast_ptr, du_ptr, ddelta_ptr, dz_ptr, dinit_ptr,
    dA_part_ptr, dD_part_ptr, dbias_part_ptr, dB_part_ptr, dC_part_ptr,
    stride_gb, stride_gd, stride_gl, stride_lb, stride_ld, stride_ln,
    stride_dub, stride_dud, stride_dul, stride_ddb, stride_ddd, stride_ddl,
    stride_dzb, stride_dzd, stride_dzl,
    B_VAR: tl.constexpr, C_VAR: tl.constexpr, HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, HAS_DLAST: tl.constexpr, SOFTPLUS: tl.constexpr,
    BLOCK_D: tl.constexpr, N_PAD: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    (pid_b, offs_d, mask_d, offs_n, mask_n, mask_dn, A, A2, Dv, bias, B_ptr, C_ptr, u_ptr,
     delta_ptr, z_ptr, ckpt_rows, ckpt_step) = program_setup(
        A_ptr, Dv_ptr, bias_ptr, B_ptr, C_ptr, u_ptr, delta_ptr, z_ptr, ckpt_ptr, D, N, SEG,
        BLOCKS_PER_SEG, D_PER_GB, D_PER_GC, stride_Ad, stride_An, stride_Dv, stride_bias,
        stride_Bb, stride_Bg, stride_Cb, stride_Cg, stride_ub, stride_db, stride_zb, B_VAR, C_VAR,
        HAS_D, HAS_BIAS, BLOCK_D, N_PAD,
    )  # fmt: skip
    offs_k = tl.arange(0, CHUNK)
    dout_ptr += pid_b * stride_gb
    du_ptr += pid_b * stride_dub
    ddelta_ptr += pid_b * stride_ddb
    dz_ptr += pid_b * stride_dzb
    # This program's (N, L) partials of a time-dependent B's and C's gradient.
    part_rows = (pid_b * tl.num_programs(0) + tl.program_id(0)) * N * L + offs_n[:, None] * L

    # The adjoint of the state after the chunk being processed; the last state's gradient first.
    carry = load_state(
        dlast_ptr, pid_b, offs_d, offs_n, mask_dn, stride_lb, stride_ld, stride_ln, HAS_DLAST,
        BLOCK_D, N_PAD,
    )  # fmt: skip
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
        u = load_tile(u_ptr, offs_d, mask_d, t, mask_t, stride_ud, stride_ul)
        dt, pre = load_dt(
            delta_ptr, bias, offs_d, mask_d, t, mask_t, stride_dd, stride_dl, SOFTPLUS
        )
        Bt = load_bc(B_ptr, offs_d, mask_d, offs_n, mask_n, t, mask_t, stride_B0, stride_B1, B_VAR)
        Ct = load_bc(C_ptr, offs_d, mask_d, offs_n, mask_n, t, mask_t, stride_C0, stride_C1, C_VAR)

        # The state before each position, h_{t-1}, recomputed from the chunk's checkpoint h0 by
        # a scan over the steps one position earlier (step t - 1 at position t); at position 0
        # the step is (1, h0), so the scan starts from h0 itself. Then a_t h_{t-1} is exactly
        # 0 where h_{t-1} is (h_t - b_t would leave the rounding error of b_t).
        first = offs_k[None, None, :] == 0
        h0 = tl.load(ckpt_rows + c * ckpt_step, mask=mask_dn, other=0.0)
        mask_p = (offs_k > 0) & (t - 1 < L)
        dt_p, _ = load_dt(
            delta_ptr, bias, offs_d, mask_d, t - 1, mask_p, stride_dd, stride_dl, SOFTPLUS
        )
        u_p = load_tile(u_ptr, offs_d, mask_d, t - 1, mask_p, stride_ud, stride_ul)
        B_p = Bt
        if B_VAR:
            B_p = load_bc(
                B_ptr, offs_d, mask_d, offs_n, mask_n, t - 1, mask_p, stride_B0, stride_B1, True
            )
        b_p = (dt_p * u_p)[:, None, :] * B_p + tl.where(first, h0[:, :, None], 0.0)
        _, h_prev = tl.associative_scan(
            (tl.exp2(dt_p[:, None, :] * A2[:, :, None]), b_p), 2, linear_combine
        )
        a = tl.exp2(dt[:, None, :] * A2[:, :, None])
        a_first = tl.sum(tl.where(first, a, 0.0), axis=2)
        decayed = a * h_prev  # a_t h_{t-1}
        hs = decayed + (dt * u)[:, None, :] * Bt  # h_t

        g = load_tile(dout_ptr, offs_d, mask_d, t, mask_t, stride_gd, stride_gl)
        if HAS_Z:
            z = load_tile(z_ptr, offs_d, mask_d, t, mask_t, stride_zd, stride_zl)
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
        dt_next, _ = load_dt(
            delta_ptr, bias, offs_d, mask_d, t + 1, t + 1 < L, stride_dd, stride_dl, SOFTPLUS
        )
        a_next = tl.exp2(dt_next[:, None, :] * A2[:, :, None])
        G = g[:, None, :] * Ct + tl.where(
            offs_k[None, None, :] == CHUNK - 1, carry[:, :, None], 0.0
        )
        _, dh = tl.associative_scan((a_next, G), 2, linear_combine, reverse=True)
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
