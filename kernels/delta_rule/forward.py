"""Triton kernels of the delta-rule family's chunked forward (notation in common.py), three
launches; USE_G (compile-time) switches the gate on (the gated delta rule), reading the log
decays g and folding the decays into the products:

`chunk_inverse_kernel`  grid (chunks, B*H): A for every chunk at once. The diagonal 16 x 16
    blocks of the triangular matrix are inverted by forward substitution (row i of every
    block in one step), then merged with tl.dot: with M = M_D + E (block diagonal plus the
    rest), A = (I + N)^{-1} M_D^{-1}, N = M_D^{-1} E nilpotent, by Horner's rule. The
    substitution runs in float32 on CUDA cores; the merge products in IEEE float32 for
    float32 inputs and in tf32 for half-precision inputs, whose A is then stored in the
    inputs' dtype (tf32 keeps fp16's 10 mantissa bits, so the merge adds no error that the
    storage would not).
`chunk_state_fwd_kernel`  grid (V blocks, B*H): the only sequential part, over chunks, with
    the state tile (K, BV) on chip; stores each chunk's start state and U rows (saved for the
    backward) and the final state. The state's value columns are independent, so V is split.
`chunk_output_kernel`  grid (V blocks, chunks, B*H): O from the saved start states and U.

USE_GK (a decay per key channel, KDA) reads g as (B, T, H, K) and forms the products with its
(C, C, K) Gamma in K blocks of BKG; USE_P (Comba) recalls with p before each step's decay.
Without the gate, g_ptr is never read, without USE_P p_ptr (any pointer will do).
"""

from __future__ import annotations

import triton
import triton.language as tl

from mecheval_kernels.delta_rule.common import (
    chunk_decays,
    chunk_rows,
    dot,
    dot_f32,
    dot_t,
    key_decays,
    key_gamma,
    key_pairs,
    key_scores,
    load_rows,
    recall_decays,
    state_program,
    state_tile,
)


@triton.jit
def chunk_inverse_kernel(
    k_ptr, p_ptr, g_ptr, beta_ptr, a_ptr, T, H, K, NT,
    C: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr, USE_G: tl.constexpr,
    USE_GK: tl.constexpr, USE_P: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_c = tl.program_id(0)
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    offs_c = tl.arange(0, C)
    t, mask_t, row_base = chunk_rows(b, h, pid_c, T, H, C)
    gram = tl.zeros((C, C), dtype=tl.float32)  # R K^T, R the recall keys (k, or Comba's p)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        kc = load_rows(k_ptr, row_base, mask_t, offs_k, offs_k < K, K)
        rc = kc
        if USE_P:
            rc = load_rows(p_ptr, row_base, mask_t, offs_k, offs_k < K, K)
        if USE_GK:
            gram += key_pairs(rc, kc, key_gamma(g_ptr, row_base, mask_t, offs_k, offs_k < K, K, C))
        else:
            gram += dot(rc, tl.trans(kc), IEEE, k_ptr.dtype.element_ty)
    beta = tl.load(beta_ptr + row_base, mask=mask_t, other=0.0).to(tl.float32)

    rows = offs_c[:, None]
    cols = offs_c[None, :]
    eye = tl.where(rows == cols, 1.0, 0.0)
    # L[i, j] = beta_i r_i.k_j (gated: times exp(G_i - G_j), Comba's exp(G_{i-1} - G_j); a decay
    # per key channel is inside the sum), j < i
    lower = gram * beta[:, None]
    if USE_G:
        if USE_P:
            _, gamma_r = recall_decays(g_ptr, row_base, mask_t, H, C)
        else:
            _, _, _, gamma_r = chunk_decays(g_ptr, row_base, mask_t, C)
        lower = lower * gamma_r
    lower = tl.where(rows > cols, lower, 0.0)
    same_block = (rows // SB) == (cols // SB)
    lower_d = tl.where(same_block, lower, 0.0)
    # Forward substitution inside every diagonal block at once: step i finalises row i of each
    # block, A[r] = e_r - sum_j L[r, j] A[j]; rows of different blocks never mix.
    inv_d = eye
    for i in range(1, SB):
        sel = (rows % SB) == i
        l_row = tl.sum(tl.where(sel, lower_d, 0.0), axis=0)  # L[r(j), j], r(j) j's block row
        update = tl.sum(l_row[:, None] * inv_d, axis=0)
        inv_d = tl.where(sel & same_block, inv_d - update[None, :], inv_d)
    inv = inv_d
    if C > SB:
        n = dot_f32(inv_d, lower - lower_d, IEEE)  # strictly block-lower: N^(C/SB) = 0
        x = eye
        for _ in tl.static_range(C // SB - 1):
            x = eye - dot_f32(n, x, IEEE)
        inv = dot_f32(x, inv_d, IEEE)
    a_base = (bh.to(tl.int64) * NT + pid_c) * C * C
    tl.store(a_ptr + a_base + rows * C + cols, inv.to(a_ptr.dtype.element_ty))


@triton.jit
def chunk_state_fwd_kernel(
    k_ptr, v_ptr, p_ptr, g_ptr, beta_ptr, a_ptr, init_ptr, h_ptr, u_ptr, final_ptr,
    T, H, K, V, NT,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr, USE_G: tl.constexpr,
    USE_GK: tl.constexpr, USE_P: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    DT = k_ptr.dtype.element_ty
    offs_c = tl.arange(0, C)
    b, h, bh64, offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv, state = state_program(
        init_ptr, H, K, V, HAS_INIT, BK, BV
    )
    for c in range(NT):
        t, mask_t, row_base = chunk_rows(b, h, c, T, H, C)
        tl.store(h_ptr + (bh64 * NT + c) * K * V + state_offs, state, mask=mask_kv)
        if USE_G:
            e, e_last, w, _ = chunk_decays(g_ptr, row_base, mask_t, C)
            if USE_P:
                e, _ = recall_decays(g_ptr, row_base, mask_t, H, C)  # the recalls' e_r
        if USE_GK:
            ek, ek_last, wk = key_decays(g_ptr, row_base, t, mask_t, offs_k, mask_k, T, H, K, C)
        kc = load_rows(k_ptr, row_base, mask_t, offs_k, mask_k, K)
        vc = load_rows(v_ptr, row_base, mask_t, offs_v, mask_v, V).to(tl.float32)
        beta = tl.load(beta_ptr + row_base, mask=mask_t, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + ((bh64 * NT + c) * C + offs_c[:, None]) * C + offs_c[None, :])
        if USE_P:
            recalled = dot(load_rows(p_ptr, row_base, mask_t, offs_k, mask_k, K), state, IEEE, DT)
        elif USE_GK:
            recalled = dot(kc.to(tl.float32) * ek, state, IEEE, DT)
        else:
            recalled = dot(kc, state, IEEE, DT)
        if USE_G:
            recalled = e[:, None] * recalled
        r = beta[:, None] * (vc - recalled)
        u = dot(a, r, IEEE, DT)
        tl.store(
            u_ptr + (bh64 * T + t)[:, None] * V + offs_v[None, :],
            u,
            mask=mask_t[:, None] & mask_v[None, :],
        )
        if USE_G:
            state = e_last * state + dot_t(kc.to(tl.float32) * w[:, None], u, IEEE, DT)
        elif USE_GK:
            state = ek_last[:, None] * state + dot_t(kc.to(tl.float32) * wk, u, IEEE, DT)
        else:
            state += dot_t(kc, u, IEEE, DT)
    if STORE_FINAL:
        tl.store(final_ptr + bh64 * K * V + state_offs, state, mask=mask_kv)


@triton.jit
def chunk_output_kernel(
    q_ptr, k_ptr, g_ptr, h_ptr, u_ptr, o_ptr, scale, T, H, K, V, NT,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKG: tl.constexpr,
    USE_G: tl.constexpr, USE_GK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    pid_c = tl.program_id(1)
    bh = tl.program_id(2)
    b, h = bh // H, bh % H
    DT = k_ptr.dtype.element_ty
    offs_c = tl.arange(0, C)
    offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv = state_tile(tl.program_id(0), K, V, BK, BV)
    t, mask_t, row_base = chunk_rows(b, h, pid_c, T, H, C)
    bh64 = bh.to(tl.int64)
    mask_tv = mask_t[:, None] & mask_v[None, :]
    if USE_G:
        e, _, _, gamma = chunk_decays(g_ptr, row_base, mask_t, C)
    qc = load_rows(q_ptr, row_base, mask_t, offs_k, mask_k, K)
    kc = load_rows(k_ptr, row_base, mask_t, offs_k, mask_k, K)
    state = tl.load(h_ptr + (bh64 * NT + pid_c) * K * V + state_offs, mask=mask_kv, other=0.0)
    u = tl.load(u_ptr + (bh64 * T + t)[:, None] * V + offs_v[None, :], mask=mask_tv, other=0.0)
    if USE_GK:
        qk = key_scores(q_ptr, k_ptr, g_ptr, row_base, mask_t, K, C, BKG)
        ek, _, _ = key_decays(g_ptr, row_base, t, mask_t, offs_k, mask_k, T, H, K, C)
        qs = dot(qc.to(tl.float32) * ek, state, IEEE, DT)
    elif USE_G:
        qk = dot(qc, tl.trans(kc), IEEE, DT) * gamma
        qs = e[:, None] * dot(qc, state, IEEE, DT)
    else:
        qk = dot(qc, tl.trans(kc), IEEE, DT)
        qk = tl.where(offs_c[:, None] >= offs_c[None, :], qk, 0.0)
        qs = dot(qc, state, IEEE, DT)
    o = (qs + dot(qk, u, IEEE, DT)) * scale
    tl.store(
        o_ptr + row_base[:, None] * V + offs_v[None, :], o.to(o_ptr.dtype.element_ty), mask=mask_tv
    )
