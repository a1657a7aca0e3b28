"""Triton kernels of the delta-rule family's chunked backward (notation in common.py), two
launches, recomputing nothing per step (only chunk-boundary states are kept); USE_G
(compile-time) switches the gate on. With dS' the gradient of a chunk's end state,

    dU = K dS' + scale * tril(Q K^T)^T dO ;  dR = A^T dU           (dR: gradient of beta V - Kb S)
    dS = dS' + scale * Q^T dO - Kb^T dR                            (the start state's gradient)

and, gated,

    dU = diag(w) K dS' + scale * (tril(Q K^T) * Gamma)^T dO ;  dR = A^T dU
    dS = e_C dS' + scale * Q^T diag(e) dO - Kb^T diag(e) dR

  `chunk_state_bwd_kernel`  grid (V blocks, B*H): the reverse pass over chunks for dS, dR.
  `chunk_grad_kernel`  grid (K blocks, chunks, B*H): dq, dk, dv, dbeta (and dg) of a chunk,
      summing over V inside the program. The gradient of each G_i (through e, w, e_C and the
      Gamma factors of both triangular matrices) is a sum over K too, so the program writes
      its K block's part, already turned into g's gradient (a reverse cumulative sum over the
      chunk, which is linear); dbeta's and dg's sums over K blocks are finished on the host in
      a fixed order (no atomics anywhere: gradients are bitwise reproducible).

With a decay per key channel (USE_GK, KDA) e, w and e_C scale channel by channel, the products
with Gamma are sums over K (`key_mix`), and G's gradient is per channel: the gradient kernel
writes dg directly for its K block. Comba (USE_P) recalls with p before each step's decay: Kb
becomes Pb with e_r and Gamma_r, and the G-gradient of those terms moves to the row before.
Without the gate, g_ptr and dg_part_ptr are never touched, without USE_P p_ptr and dp_ptr (any
pointers will do).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mecheval_kernels.delta_rule.common import (
    chunk_decays,
    chunk_rows,
    dot,
    dot_t,
    key_decays,
    key_gamma,
    key_mix,
    key_mix_t,
    key_scores,
    load_rows,
    recall_decays,
    state_program,
)


@triton.jit
def chunk_state_bwd_kernel(
    q_ptr, k_ptr, p_ptr, g_ptr, beta_ptr, a_ptr, do_ptr, dfinal_ptr, dh_ptr, dr_ptr, dinit_ptr,
    scale, T, H, K, V, NT,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKG: tl.constexpr,
    HAS_DFINAL: tl.constexpr, STORE_DINIT: tl.constexpr, USE_G: tl.constexpr,
    USE_GK: tl.constexpr, USE_P: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    DT = k_ptr.dtype.element_ty
    offs_c = tl.arange(0, C)
    b, h, bh64, offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv, dstate = state_program(
        dfinal_ptr, H, K, V, HAS_DFINAL, BK, BV
    )
    for i in range(NT):
        c = NT - 1 - i
        t, mask_t, row_base = chunk_rows(b, h, c, T, H, C)
        mask_tv = mask_t[:, None] & mask_v[None, :]
        tl.store(dh_ptr + (bh64 * NT + c) * K * V + state_offs, dstate, mask=mask_kv)
        if USE_G:
            e, e_last, w, gamma = chunk_decays(g_ptr, row_base, mask_t, C)
            e_r = e
            if USE_P:
                e_r, _ = recall_decays(g_ptr, row_base, mask_t, H, C)
        if USE_GK:
            ek, ek_last, wk = key_decays(g_ptr, row_base, t, mask_t, offs_k, mask_k, T, H, K, C)
        qc = load_rows(q_ptr, row_base, mask_t, offs_k, mask_k, K)
        kc = load_rows(k_ptr, row_base, mask_t, offs_k, mask_k, K)
        do = load_rows(do_ptr, row_base, mask_t, offs_v, mask_v, V)
        beta = tl.load(beta_ptr + row_base, mask=mask_t, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + ((bh64 * NT + c) * C + offs_c[:, None]) * C + offs_c[None, :])
        if USE_GK:  # (sum_d q_id k_jd Gamma[i, j, d])^T
            kq = tl.trans(key_scores(q_ptr, k_ptr, g_ptr, row_base, mask_t, K, C, BKG))
            kw = kc.to(tl.float32) * wk
        elif USE_G:
            kq = dot(kc, tl.trans(qc), IEEE, DT)  # kq[j, i] = k_j.q_i: (Q K^T)^T
            kq = kq * tl.trans(gamma)  # (tril(Q K^T) * Gamma)^T
            kw = kc.to(tl.float32) * w[:, None]
        else:
            kq = dot(kc, tl.trans(qc), IEEE, DT)
            kq = tl.where(offs_c[:, None] <= offs_c[None, :], kq, 0.0)
            kw = kc
        du = dot(kw, dstate, IEEE, DT) + scale * dot(kq, do, IEEE, DT)
        dr = dot(tl.trans(a), du, IEEE, DT)
        tl.store(dr_ptr + (bh64 * T + t)[:, None] * V + offs_v[None, :], dr, mask=mask_tv)
        # Q^T diag(e) dO and Kb^T diag(e) dR = K^T (diag(beta e) dR): scale the narrower tiles.
        if USE_GK:
            dstate = ek_last[:, None] * dstate + scale * dot_t(qc.to(tl.float32) * ek, do, IEEE, DT)
            dstate -= dot_t(kc.to(tl.float32) * ek, beta[:, None] * dr, IEEE, DT)
        elif USE_G:
            rc = kc
            if USE_P:
                rc = load_rows(p_ptr, row_base, mask_t, offs_k, mask_k, K)
            dstate = e_last * dstate + scale * dot_t(qc, e[:, None] * do, IEEE, DT)
            dstate -= dot_t(rc, (beta * e_r)[:, None] * dr, IEEE, DT)
        else:
            dstate += scale * dot_t(qc, do, IEEE, DT)
            dstate -= dot_t(kc, beta[:, None] * dr, IEEE, DT)
    if STORE_DINIT:
        tl.store(dinit_ptr + bh64 * K * V + state_offs, dstate, mask=mask_kv)


@triton.jit
def _rows_at(do_ptr, u_ptr, dr_ptr, row_base, bh64, t, mask_t, v0, T, V, BV: tl.constexpr):
    """The chunk's dO, U and dR rows at value columns [v0, v0 + BV): (offs_v, mask_v,
    mask_tv, do, u, dr)."""
    offs_v = v0 + tl.arange(0, BV)
    mask_v = offs_v < V
    mask_tv = mask_t[:, None] & mask_v[None, :]
    tv_offs = (bh64 * T + t)[:, None] * V + offs_v[None, :]
    do = load_rows(do_ptr, row_base, mask_t, offs_v, mask_v, V)
    u = tl.load(u_ptr + tv_offs, mask=mask_tv, other=0.0)
    dr = tl.load(dr_ptr + tv_offs, mask=mask_tv, other=0.0)
    return offs_v, mask_v, mask_tv, do, u, dr


@triton.jit
def _row_minus_column(x):
    """The gradient of each G_i from a matrix of gradient-times-value entries that depend on
    G_i - G_j (see torch_path._row_minus_column)."""
    return tl.sum(x, axis=1) - tl.sum(x, axis=0)


@triton.jit
def _shift_up(x, C: tl.constexpr):
    """y[i] = x[i + 1] (zero for the last row): Comba's recall at step i reads G_{i-1}."""
    offs = tl.arange(0, C)
    return tl.sum(tl.where(offs[None, :] == offs[:, None] + 1, x[None, :], 0.0), axis=1)


@triton.jit
def chunk_grad_kernel(
    q_ptr, k_ptr, v_ptr, p_ptr, g_ptr, beta_ptr, h_ptr, dh_ptr, u_ptr, dr_ptr, do_ptr,
    dq_ptr, dk_ptr, dv_ptr, dp_ptr, dbeta_part_ptr, dg_part_ptr, scale, B, T, H, K, V, NT,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr,
    USE_GK: tl.constexpr, USE_P: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_k = tl.program_id(0)
    pid_c = tl.program_id(1)
    bh = tl.program_id(2)
    b, h = bh // H, bh % H
    DT = k_ptr.dtype.element_ty
    offs_c = tl.arange(0, C)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask_k = offs_k < K
    t, mask_t, row_base = chunk_rows(b, h, pid_c, T, H, C)
    bh64 = bh.to(tl.int64)
    state_base = (bh64 * NT + pid_c) * K * V
    mask_tk = mask_t[:, None] & mask_k[None, :]
    qc = load_rows(q_ptr, row_base, mask_t, offs_k, mask_k, K)
    kc = load_rows(k_ptr, row_base, mask_t, offs_k, mask_k, K)
    rc = kc  # the recall keys: k, or Comba's p
    if USE_P:
        rc = load_rows(p_ptr, row_base, mask_t, offs_k, mask_k, K)
    beta = tl.load(beta_ptr + row_base, mask=mask_t, other=0.0).to(tl.float32)
    if USE_G:
        e, e_last, w, gamma = chunk_decays(g_ptr, row_base, mask_t, C)
        e_r = e
        gamma_r = gamma
        if USE_P:
            e_r, gamma_r = recall_decays(g_ptr, row_base, mask_t, H, C)
    if USE_GK:
        ek, ek_last, wk = key_decays(g_ptr, row_base, t, mask_t, offs_k, mask_k, T, H, K, C)
        gk = key_gamma(g_ptr, row_base, mask_t, offs_k, mask_k, K, C)

    # Pass 1 over V: the (C, C) products, dv, and beta's V-part (the last two do not depend on
    # the K block: the first K block writes them).
    do_u = tl.zeros((C, C), dtype=tl.float32)  # dO U^T
    dr_u = tl.zeros((C, C), dtype=tl.float32)  # dR U^T
    dbeta_v = tl.zeros((C,), dtype=tl.float32)  # from diag(beta) V
    first_k = (offs_c * 0 + pid_k) == 0  # (C,): whether this is the first K block
    for v0 in range(0, V, BV):
        offs_v, mask_v, mask_tv, do, u, dr = _rows_at(
            do_ptr, u_ptr, dr_ptr, row_base, bh64, t, mask_t, v0, T, V, BV
        )
        vc = load_rows(v_ptr, row_base, mask_t, offs_v, mask_v, V)
        do_u += dot(do, tl.trans(u), IEEE, DT)
        dr_u += dot(dr, tl.trans(u), IEEE, DT)
        dbeta_v += tl.sum(dr * vc.to(tl.float32), axis=1)
        tl.store(
            dv_ptr + row_base[:, None] * V + offs_v[None, :],
            (beta[:, None] * dr).to(dv_ptr.dtype.element_ty),
            mask=mask_tv & first_k[:, None],
        )
    rows = offs_c[:, None]
    cols = offs_c[None, :]
    rb = rc.to(tl.float32) * beta[:, None]
    if USE_G:
        dqk = do_u * scale * gamma  # gradient of Q K^T (gamma is zero above the diagonal)
        dl = tl.where(rows > cols, -dr_u * gamma_r, 0.0)  # gradient of Rb K^T (strictly lower)
    else:
        dqk = tl.where(rows >= cols, do_u * scale, 0.0)  # gradient of tril(Q K^T) (times Gamma)
        dl = tl.where(rows > cols, -dr_u, 0.0)  # gradient of tril(Rb K^T, -1) (times Gamma)
    if USE_GK:  # through Gamma channel by channel: G_i gets x_i dx_i, G_j gets -y_j dy_j
        dq = key_mix(dqk, kc, gk)
        dk_p = key_mix_t(dqk, qc, gk)
        drb = key_mix(dl, kc, gk)
        dk_l = key_mix_t(dl, rb, gk)
        dG = qc.to(tl.float32) * dq - kc.to(tl.float32) * (dk_p + dk_l) + rb * drb
        dk = dk_p + dk_l
    else:
        if USE_G:
            # The Gamma-dependent parts of G's gradient, this K block's share of Q K^T, Rb K^T;
            # dG_r collects those of the recalls (G_i, Comba's G_{i-1}).
            dG = _row_minus_column(dqk * dot(qc, tl.trans(kc), IEEE, DT))
            l_part = dl * beta[:, None] * dot(rc, tl.trans(kc), IEEE, DT)
            dG -= tl.sum(l_part, axis=0)
            dG_r = tl.sum(l_part, axis=1)
        dq = dot(dqk, kc, IEEE, DT)
        dk = dot(tl.trans(dqk), qc, IEEE, DT) + dot(tl.trans(dl), rb, IEEE, DT)
        drb = dot(dl, kc, IEEE, DT)  # gradient of Rb = diag(beta) R
    # Pass 2 over V: the terms through the chunk's start state and its gradient (gated: summed
    # over V first, then scaled by the decays).
    if USE_G or USE_GK:
        do_s = tl.zeros((C, BK), dtype=tl.float32)  # dO S^T
        dr_s = tl.zeros((C, BK), dtype=tl.float32)  # dR S^T
        u_ds = tl.zeros((C, BK), dtype=tl.float32)  # U dS'^T
        s_ds = tl.zeros((BK,), dtype=tl.float32)  # <S, dS'> per key row
    for v0 in range(0, V, BV):
        offs_v, mask_v, mask_tv, do, u, dr = _rows_at(
            do_ptr, u_ptr, dr_ptr, row_base, bh64, t, mask_t, v0, T, V, BV
        )
        kv_offs = offs_k[:, None] * V + offs_v[None, :]
        mask_kv = mask_k[:, None] & mask_v[None, :]
        state = tl.load(h_ptr + state_base + kv_offs, mask=mask_kv, other=0.0)
        dstate = tl.load(dh_ptr + state_base + kv_offs, mask=mask_kv, other=0.0)
        if USE_G or USE_GK:
            do_s += dot(do, tl.trans(state), IEEE, DT)
            dr_s += dot(dr, tl.trans(state), IEEE, DT)
            u_ds += dot(u, tl.trans(dstate), IEEE, DT)
            s_ds += tl.sum(state * dstate, axis=1)
        else:
            dq += scale * dot(do, tl.trans(state), IEEE, DT)
            dk += dot(u, tl.trans(dstate), IEEE, DT)
            drb -= dot(dr, tl.trans(state), IEEE, DT)
    if USE_GK:
        dq += scale * ek * do_s
        dk += wk * u_ds
        drb -= ek * dr_s
        through_w = wk * kc.to(tl.float32) * u_ds
        dG += scale * ek * qc.to(tl.float32) * do_s - ek * rb * dr_s - through_w
        last = ek_last * s_ds + tl.sum(through_w, axis=0)  # e_C and w's G_C: the last row
        dG += tl.where(rows == C - 1, last[None, :], 0.0)
        # G_i = g_1 + ... + g_i channel by channel: dg_j = sum_{i >= j} dG_i.
        tl.store(
            dg_part_ptr + row_base[:, None] * K + offs_k[None, :],
            tl.cumsum(dG, 0, reverse=True),
            mask=mask_tk,
        )
    if USE_G:
        dq += scale * e[:, None] * do_s
        dk += w[:, None] * u_ds
        drb -= e_r[:, None] * dr_s
        through_w = w * tl.sum(kc.to(tl.float32) * u_ds, axis=1)
        dG += scale * e * tl.sum(qc.to(tl.float32) * do_s, axis=1) - through_w
        dG_r -= e_r * tl.sum(rb * dr_s, axis=1)
        if USE_P:
            dG += _shift_up(dG_r, C)
        else:
            dG += dG_r
        # e_C and w's G_C: the chunk's last row (a padded one in a ragged chunk: G_C all the
        # same).
        last = e_last * tl.sum(s_ds, axis=0) + tl.sum(through_w, axis=0)
        dG += tl.where(offs_c == C - 1, last, 0.0)
        # G_i = g_1 + ... + g_i: dg_j = sum_{i >= j} dG_i, summed directly (no cancellation).
        dg = tl.sum(tl.where(rows >= cols, dG[:, None], 0.0), axis=0)
    if USE_P:
        tl.store(
            dp_ptr + row_base[:, None] * K + offs_k[None, :],
            (beta[:, None] * drb).to(dp_ptr.dtype.element_ty),
            mask=mask_tk,
        )
    else:
        dk += beta[:, None] * drb
    dbeta = tl.sum(drb * rc.to(tl.float32), axis=1) + tl.where(first_k, dbeta_v, 0.0)
    tl.store(
        dq_ptr + row_base[:, None] * K + offs_k[None, :],
        dq.to(dq_ptr.dtype.element_ty),
        mask=mask_tk,
    )
    tl.store(
        dk_ptr + row_base[:, None] * K + offs_k[None, :],
        dk.to(dk_ptr.dtype.element_ty),
        mask=mask_tk,
    )
    part = pid_k.to(tl.int64) * B * T * H
    tl.store(dbeta_part_ptr + part + row_base, dbeta, mask=mask_t)
    if USE_G:
        tl.store(dg_part_ptr + part + row_base, dg, mask=mask_t)
