"""Triton forward and backward of the delta rule: chunked kernels and a fused recurrent kernel.

Notation per batch row and head (see reference.py): state S (K, V); a chunk is C consecutive
steps with rows Q, K (C, K), V (C, V), beta (C); Kb = diag(beta) K. Within a chunk the steps
unroll to the WY form

    A = (I + tril(Kb K^T, -1))^{-1}        (C, C), unit lower triangular
    U = A (diag(beta) V - Kb S)            the chunk's u_t rows
    O = scale * (Q S + tril(Q K^T) U)      (tril keeps the diagonal: o_t reads S_t)
    S' = S + K^T U

Chunked forward, three launches:
  `_chunk_inverse_kernel`  grid (chunks, B*H): A for every chunk at once. The diagonal 16 x 16
      blocks of the triangular matrix are inverted by forward substitution (row i of every
      block in one step), then merged with tl.dot: with M = M_D + E (block diagonal plus the
      rest), A = (I + N)^{-1} M_D^{-1}, N = M_D^{-1} E nilpotent, by Horner's rule.
  `_chunk_state_fwd_kernel`  grid (V blocks, B*H): the only sequential part, over chunks, with
      the state tile (K, BV) on chip; stores each chunk's start state and U rows (saved for the
      backward) and the final state. The state's value columns are independent, so V is split.
  `_chunk_output_kernel`  grid (V blocks, chunks, B*H): O from the saved start states and U.

Chunked backward, two launches, recomputing nothing per step (only chunk-boundary states are
kept): with dS' the gradient of a chunk's end state,

    dU = K dS' + scale * tril(Q K^T)^T dO ;  dR = A^T dU           (dR: gradient of beta V - Kb S)
    dS = dS' + scale * Q^T dO - Kb^T dR                            (the start state's gradient)
  `_chunk_state_bwd_kernel`  grid (V blocks, B*H): the reverse pass over chunks for dS, dR.
  `_chunk_grad_kernel`  grid (K blocks, chunks, B*H): dq, dk, dv, dbeta of a chunk, summing
      over V inside the program; dbeta's sum over K is finished on the host from per-K-block
      partials (a fixed-order sum: no atomics anywhere, so gradients are bitwise reproducible).

Fused recurrent kernel (short sequences, single-step decoding): grid (V blocks, B*H), one step
at a time with the state tile on chip; saves the u_t rows. Its backward runs a reverse pass
(gradient of the state, dv, du, the first part of dk) and then a forward pass that replays the
state from the initial state and the saved u rows (dq, the rest of dk, dbeta); gradients that
sum over V are written per V block and summed on the host in a fixed order.

Chunks are C = 32 steps for every dtype (see `chunk_size`: on sm_90, 64-row products lowered to
wgmma, which mis-compiled here), and every product keeps at most 32 rows (`_dot_t`).

Precision: states and accumulators in float32; with float32 inputs every tl.dot runs in IEEE
float32, with float16/bfloat16 inputs tl.dot takes half-precision operands and accumulates in
float32. The chunk inverse's substitution runs in float32 on CUDA cores; its merge products run
in IEEE float32 for float32 inputs and in tf32 for half-precision inputs, whose A is then stored
in the inputs' dtype (tf32 keeps fp16's 10 mantissa bits, so the merge adds no error that the
storage would not).

Global memory read back in the launch that wrote it: only `_recurrent_bwd_kernel` does so (its
forward pass reads the du rows and dk partials that its reverse pass stored, in other threads'
layouts), with a tl.debug_barrier() between the passes. Every other kernel reads only what
earlier launches wrote (on one stream, so in order), and no two programs of a launch write the
same element. Buffers are allocated with torch.empty (`_empty`) and each is fully written
before it is read: the tests make them start as NaN to check it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

SUB_BLOCK = 16  # diagonal blocks of the chunk inverse, inverted by substitution


def chunk_size(K: int, dtype: torch.dtype) -> int:
    """Steps per chunk: 32 for every head size and dtype.

    64-step chunks make the (C, .) tiles of tl.dot 64 rows tall, and Triton (3.6) then lowers the
    half-precision products to sm_90's wgmma. On an H200 those wgmma lowerings were wrong for
    these kernels' narrow V tiles: compute-sanitizer reported shared-memory reads out of bounds
    at the tl.dot of `_chunk_output_kernel` and `_chunk_state_bwd_kernel`, the output was
    garbage (relative error 1 to 4) and the K = 100 backward hit an illegal address, while the
    same code on 32-row tiles (mma.sync) passed everywhere. With C = 32 and the K-by-V products
    taken transposed (`_dot_t`), every product has at most 32 rows and lowers to mma.sync;
    compile_check fails if a wgmma instruction comes back. On the H200 this passes every
    delta-rule test, clean under compute-sanitizer. It costs time: at B4 T2048 H16 K=V=128
    bf16 the forward takes 0.60 ms and forward+backward 2.39 ms, against 0.45 and 1.25 ms for
    the 64-step kernels (which were right at that shape only). (For float32 inputs the IEEE
    products run on CUDA cores, whose whole reduction sits in registers: 64-row tiles spill.)
    """
    return 32


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, DT: tl.constexpr):
    """a @ b accumulated in float32: IEEE float32 operands, or operands in DT (fp16/bf16)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def _dot_f32(a, b, IEEE: tl.constexpr):
    """a @ b of float32 tiles: IEEE, or tf32 where the result is rounded to fp16/bf16 anyway."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_t(a, b, IEEE: tl.constexpr, DT: tl.constexpr):
    """a^T @ b. In half precision it is computed as (b^T a)^T: the (K, V) state updates K^T U
    have K rows (up to 256) but only BV (<= 32) columns, and the transposed product keeps the
    tile that tl.dot sees at BV rows, so it lowers to mma.sync rather than sm_90's wgmma (see
    `chunk_size`). IEEE float32 products run on CUDA cores either way."""
    if IEEE:
        return _dot(tl.trans(a), b, IEEE, DT)
    else:
        return tl.trans(_dot(tl.trans(b), a, IEEE, DT))


# ------------------------------------------------------------------------------------------
# Chunked forward
# ------------------------------------------------------------------------------------------


@triton.jit
def _chunk_inverse_kernel(
    k_ptr,
    beta_ptr,
    a_ptr,
    T,
    H,
    K,
    NT,
    C: tl.constexpr,
    SB: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_c = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_c = tl.arange(0, C)
    t = (pid_c * C + offs_c).to(tl.int64)
    mask_t = t < T
    row_base = (b.to(tl.int64) * T + t) * H + h  # (b, t, h) flattened
    gram = tl.zeros((C, C), dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        kc = tl.load(
            k_ptr + row_base[:, None] * K + offs_k[None, :],
            mask=mask_t[:, None] & (offs_k < K)[None, :],
            other=0.0,
        )
        gram += _dot(kc, tl.trans(kc), IEEE, k_ptr.dtype.element_ty)
    beta = tl.load(beta_ptr + row_base, mask=mask_t, other=0.0).to(tl.float32)

    rows = offs_c[:, None]
    cols = offs_c[None, :]
    eye = tl.where(rows == cols, 1.0, 0.0)
    lower = tl.where(rows > cols, gram * beta[:, None], 0.0)  # L[i, j] = beta_i k_i.k_j, j < i
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
        n = _dot_f32(inv_d, lower - lower_d, IEEE)  # strictly block-lower: N^(C/SB) = 0
        x = eye
        for _ in tl.static_range(C // SB - 1):
            x = eye - _dot_f32(n, x, IEEE)
        inv = _dot_f32(x, inv_d, IEEE)
    a_base = (bh.to(tl.int64) * NT + pid_c) * C * C
    tl.store(a_ptr + a_base + rows * C + cols, inv.to(a_ptr.dtype.element_ty))


@triton.jit
def _chunk_state_fwd_kernel(
    k_ptr,
    v_ptr,
    beta_ptr,
    a_ptr,
    init_ptr,
    h_ptr,
    u_ptr,
    final_ptr,
    T,
    H,
    K,
    V,
    NT,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_v = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    DT = k_ptr.dtype.element_ty
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    state_offs = offs_k[:, None] * V + offs_v[None, :]
    bh64 = bh.to(tl.int64)
    if HAS_INIT:
        state = tl.load(init_ptr + bh64 * K * V + state_offs, mask=mask_kv, other=0.0)
        state = state.to(tl.float32)
    else:
        state = tl.zeros((BK, BV), dtype=tl.float32)
    for c in range(NT):
        t = (c * C + offs_c).to(tl.int64)
        mask_t = t < T
        row_base = (b.to(tl.int64) * T + t) * H + h
        tl.store(h_ptr + (bh64 * NT + c) * K * V + state_offs, state, mask=mask_kv)
        kc = tl.load(
            k_ptr + row_base[:, None] * K + offs_k[None, :],
            mask=mask_t[:, None] & mask_k[None, :],
            other=0.0,
        )
        vc = tl.load(
            v_ptr + row_base[:, None] * V + offs_v[None, :],
            mask=mask_t[:, None] & mask_v[None, :],
            other=0.0,
        ).to(tl.float32)
        beta = tl.load(beta_ptr + row_base, mask=mask_t, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + ((bh64 * NT + c) * C + offs_c[:, None]) * C + offs_c[None, :])
        r = beta[:, None] * (vc - _dot(kc, state, IEEE, DT))
        u = _dot(a, r, IEEE, DT)
        tl.store(
            u_ptr + (bh64 * T + t)[:, None] * V + offs_v[None, :],
            u,
            mask=mask_t[:, None] & mask_v[None, :],
        )
        state += _dot_t(kc, u, IEEE, DT)
    if STORE_FINAL:
        tl.store(final_ptr + bh64 * K * V + state_offs, state, mask=mask_kv)


@triton.jit
def _chunk_output_kernel(
    q_ptr,
    k_ptr,
    h_ptr,
    u_ptr,
    o_ptr,
    scale,
    T,
    H,
    K,
    V,
    NT,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_v = tl.program_id(0)
    pid_c = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    DT = k_ptr.dtype.element_ty
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    t = (pid_c * C + offs_c).to(tl.int64)
    mask_t = t < T
    row_base = (b.to(tl.int64) * T + t) * H + h
    bh64 = bh.to(tl.int64)
    mask_tk = mask_t[:, None] & mask_k[None, :]
    mask_tv = mask_t[:, None] & mask_v[None, :]
    qc = tl.load(q_ptr + row_base[:, None] * K + offs_k[None, :], mask=mask_tk, other=0.0)
    kc = tl.load(k_ptr + row_base[:, None] * K + offs_k[None, :], mask=mask_tk, other=0.0)
    state = tl.load(
        h_ptr + (bh64 * NT + pid_c) * K * V + offs_k[:, None] * V + offs_v[None, :],
        mask=mask_k[:, None] & mask_v[None, :],
        other=0.0,
    )
    u = tl.load(u_ptr + (bh64 * T + t)[:, None] * V + offs_v[None, :], mask=mask_tv, other=0.0)
    qk = _dot(qc, tl.trans(kc), IEEE, DT)
    qk = tl.where(offs_c[:, None] >= offs_c[None, :], qk, 0.0)
    o = (_dot(qc, state, IEEE, DT) + _dot(qk, u, IEEE, DT)) * scale
    tl.store(
        o_ptr + row_base[:, None] * V + offs_v[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=mask_tv,
    )


# ------------------------------------------------------------------------------------------
# Chunked backward
# ------------------------------------------------------------------------------------------


@triton.jit
def _chunk_state_bwd_kernel(
    q_ptr,
    k_ptr,
    beta_ptr,
    a_ptr,
    do_ptr,
    dfinal_ptr,
    dh_ptr,
    dr_ptr,
    dinit_ptr,
    scale,
    T,
    H,
    K,
    V,
    NT,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
    STORE_DINIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_v = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    DT = k_ptr.dtype.element_ty
    offs_c = tl.arange(0, C)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    state_offs = offs_k[:, None] * V + offs_v[None, :]
    bh64 = bh.to(tl.int64)
    if HAS_DFINAL:
        dstate = tl.load(dfinal_ptr + bh64 * K * V + state_offs, mask=mask_kv, other=0.0)
        dstate = dstate.to(tl.float32)
    else:
        dstate = tl.zeros((BK, BV), dtype=tl.float32)
    for i in range(NT):
        c = NT - 1 - i
        t = (c * C + offs_c).to(tl.int64)
        mask_t = t < T
        row_base = (b.to(tl.int64) * T + t) * H + h
        mask_tk = mask_t[:, None] & mask_k[None, :]
        mask_tv = mask_t[:, None] & mask_v[None, :]
        tl.store(dh_ptr + (bh64 * NT + c) * K * V + state_offs, dstate, mask=mask_kv)
        qc = tl.load(q_ptr + row_base[:, None] * K + offs_k[None, :], mask=mask_tk, other=0.0)
        kc = tl.load(k_ptr + row_base[:, None] * K + offs_k[None, :], mask=mask_tk, other=0.0)
        do = tl.load(do_ptr + row_base[:, None] * V + offs_v[None, :], mask=mask_tv, other=0.0)
        beta = tl.load(beta_ptr + row_base, mask=mask_t, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + ((bh64 * NT + c) * C + offs_c[:, None]) * C + offs_c[None, :])
        kq = _dot(kc, tl.trans(qc), IEEE, DT)  # kq[j, i] = k_j.q_i: (Q K^T)^T
        kq = tl.where(offs_c[:, None] <= offs_c[None, :], kq, 0.0)
        du = _dot(kc, dstate, IEEE, DT) + scale * _dot(kq, do, IEEE, DT)
        dr = _dot(tl.trans(a), du, IEEE, DT)
        tl.store(dr_ptr + (bh64 * T + t)[:, None] * V + offs_v[None, :], dr, mask=mask_tv)
        # Kb^T dR = K^T (diag(beta) dR): scale the narrower tile.
        dstate += scale * _dot_t(qc, do, IEEE, DT)
        dstate -= _dot_t(kc, beta[:, None] * dr, IEEE, DT)
    if STORE_DINIT:
        tl.store(dinit_ptr + bh64 * K * V + state_offs, dstate, mask=mask_kv)


@triton.jit
def _chunk_grad_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    h_ptr,
    dh_ptr,
    u_ptr,
    dr_ptr,
    do_ptr,
    dq_ptr,
    dk_ptr,
    dv_ptr,
    dbeta_part_ptr,
    scale,
    B,
    T,
    H,
    K,
    V,
    NT,
    C: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_k = tl.program_id(0)
    pid_c = tl.program_id(1)
    bh = tl.program_id(2)
    b = bh // H
    h = bh % H
    DT = k_ptr.dtype.element_ty
    offs_c = tl.arange(0, C)
    offs_k = pid_k * BK + tl.arange(0, BK)
    mask_k = offs_k < K
    t = (pid_c * C + offs_c).to(tl.int64)
    mask_t = t < T
    row_base = (b.to(tl.int64) * T + t) * H + h
    bh64 = bh.to(tl.int64)
    state_base = (bh64 * NT + pid_c) * K * V
    mask_tk = mask_t[:, None] & mask_k[None, :]
    qc = tl.load(q_ptr + row_base[:, None] * K + offs_k[None, :], mask=mask_tk, other=0.0)
    kc = tl.load(k_ptr + row_base[:, None] * K + offs_k[None, :], mask=mask_tk, other=0.0)
    beta = tl.load(beta_ptr + row_base, mask=mask_t, other=0.0).to(tl.float32)

    # Pass 1 over V: the (C, C) products, dv, and beta's V-part (the last two do not depend on
    # the K block: the first K block writes them).
    do_u = tl.zeros((C, C), dtype=tl.float32)  # dO U^T
    dr_u = tl.zeros((C, C), dtype=tl.float32)  # dR U^T
    dbeta_v = tl.zeros((C,), dtype=tl.float32)  # from diag(beta) V
    first_k = (offs_c * 0 + pid_k) == 0  # (C,): whether this is the first K block
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        mask_tv = mask_t[:, None] & (offs_v < V)[None, :]
        tv_offs = (bh64 * T + t)[:, None] * V + offs_v[None, :]
        do = tl.load(do_ptr + row_base[:, None] * V + offs_v[None, :], mask=mask_tv, other=0.0)
        vc = tl.load(v_ptr + row_base[:, None] * V + offs_v[None, :], mask=mask_tv, other=0.0)
        u = tl.load(u_ptr + tv_offs, mask=mask_tv, other=0.0)
        dr = tl.load(dr_ptr + tv_offs, mask=mask_tv, other=0.0)
        do_u += _dot(do, tl.trans(u), IEEE, DT)
        dr_u += _dot(dr, tl.trans(u), IEEE, DT)
        dbeta_v += tl.sum(dr * vc.to(tl.float32), axis=1)
        tl.store(
            dv_ptr + row_base[:, None] * V + offs_v[None, :],
            (beta[:, None] * dr).to(dv_ptr.dtype.element_ty),
            mask=mask_tv & first_k[:, None],
        )
    rows = offs_c[:, None]
    cols = offs_c[None, :]
    dqk = tl.where(rows >= cols, do_u * scale, 0.0)  # gradient of tril(Q K^T)
    dl = tl.where(rows > cols, -dr_u, 0.0)  # gradient of tril(Kb K^T, -1)
    kb = kc.to(tl.float32) * beta[:, None]
    dq = _dot(dqk, kc, IEEE, DT)
    dk = _dot(tl.trans(dqk), qc, IEEE, DT) + _dot(tl.trans(dl), kb, IEEE, DT)
    dkb = _dot(dl, kc, IEEE, DT)  # gradient of Kb = diag(beta) K
    # Pass 2 over V: the terms through the chunk's start state and its gradient.
    for v0 in range(0, V, BV):
        offs_v = v0 + tl.arange(0, BV)
        mask_v = offs_v < V
        mask_tv = mask_t[:, None] & mask_v[None, :]
        kv_offs = offs_k[:, None] * V + offs_v[None, :]
        mask_kv = mask_k[:, None] & mask_v[None, :]
        state = tl.load(h_ptr + state_base + kv_offs, mask=mask_kv, other=0.0)
        dstate = tl.load(dh_ptr + state_base + kv_offs, mask=mask_kv, other=0.0)
        tv_offs = (bh64 * T + t)[:, None] * V + offs_v[None, :]
        do = tl.load(do_ptr + row_base[:, None] * V + offs_v[None, :], mask=mask_tv, other=0.0)
        u = tl.load(u_ptr + tv_offs, mask=mask_tv, other=0.0)
        dr = tl.load(dr_ptr + tv_offs, mask=mask_tv, other=0.0)
        dq += scale * _dot(do, tl.trans(state), IEEE, DT)
        dk += _dot(u, tl.trans(dstate), IEEE, DT)
        dkb -= _dot(dr, tl.trans(state), IEEE, DT)
    dk += beta[:, None] * dkb
    dbeta = tl.sum(dkb * kc.to(tl.float32), axis=1) + tl.where(first_k, dbeta_v, 0.0)
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


# ------------------------------------------------------------------------------------------
# Fused recurrent forward and backward
# ------------------------------------------------------------------------------------------


@triton.jit
def _recurrent_fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    init_ptr,
    o_ptr,
    u_ptr,
    final_ptr,
    scale,
    T,
    H,
    K,
    V,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_INIT: tl.constexpr,
    STORE_FINAL: tl.constexpr,
):
    pid_v = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    state_offs = offs_k[:, None] * V + offs_v[None, :]
    bh64 = bh.to(tl.int64)
    if HAS_INIT:
        state = tl.load(init_ptr + bh64 * K * V + state_offs, mask=mask_kv, other=0.0)
        state = state.to(tl.float32)
    else:
        state = tl.zeros((BK, BV), dtype=tl.float32)
    # Pointers at step 0, advanced by one step (H rows of the (B, T, H, .) layout) per step.
    row = b.to(tl.int64) * T * H + h
    p_q = q_ptr + row * K + offs_k
    p_k = k_ptr + row * K + offs_k
    p_v = v_ptr + row * V + offs_v
    p_o = o_ptr + row * V + offs_v
    p_beta = beta_ptr + row
    p_u = u_ptr + bh64 * T * V + offs_v
    for _ in range(T):
        kt = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        qt = tl.load(p_q, mask=mask_k, other=0.0).to(tl.float32)
        vt = tl.load(p_v, mask=mask_v, other=0.0).to(tl.float32)
        beta = tl.load(p_beta).to(tl.float32)
        u = beta * (vt - tl.sum(state * kt[:, None], axis=0))
        tl.store(p_u, u, mask=mask_v)
        state += kt[:, None] * u[None, :]
        o = tl.sum(state * qt[:, None], axis=0) * scale
        tl.store(p_o, o.to(o_ptr.dtype.element_ty), mask=mask_v)
        p_q += H * K
        p_k += H * K
        p_v += H * V
        p_o += H * V
        p_beta += H
        p_u += V
    if STORE_FINAL:
        tl.store(final_ptr + bh64 * K * V + state_offs, state, mask=mask_kv)


@triton.jit
def _recurrent_bwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    beta_ptr,
    init_ptr,
    u_ptr,
    do_ptr,
    dfinal_ptr,
    du_ptr,
    dq_part_ptr,
    dk_part_ptr,
    dv_ptr,
    dbeta_part_ptr,
    dinit_ptr,
    scale,
    B,
    T,
    H,
    K,
    V,
    BK: tl.constexpr,
    BV: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_DFINAL: tl.constexpr,
    STORE_DINIT: tl.constexpr,
):
    pid_v = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_kv = mask_k[:, None] & mask_v[None, :]
    state_offs = offs_k[:, None] * V + offs_v[None, :]
    bh64 = bh.to(tl.int64)
    # This V block's slice of the partial sums over V blocks: (NV, B, T, H, .).
    part = pid_v.to(tl.int64) * B * T * H
    row = b.to(tl.int64) * T * H + h  # (b, 0, h)
    last = row + (T - 1) * H  # (b, T - 1, h)

    # Reverse pass: the state's gradient, and what needs no state.
    if HAS_DFINAL:
        dstate = tl.load(dfinal_ptr + bh64 * K * V + state_offs, mask=mask_kv, other=0.0)
        dstate = dstate.to(tl.float32)
    else:
        dstate = tl.zeros((BK, BV), dtype=tl.float32)
    p_q = q_ptr + last * K + offs_k
    p_k = k_ptr + last * K + offs_k
    p_do = do_ptr + last * V + offs_v
    p_dv = dv_ptr + last * V + offs_v
    p_beta = beta_ptr + last
    p_dk = dk_part_ptr + (part + last) * K + offs_k
    p_u = u_ptr + (bh64 * T + T - 1) * V + offs_v
    p_du = du_ptr + (bh64 * T + T - 1) * V + offs_v
    for _ in range(T):
        kt = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        qt = tl.load(p_q, mask=mask_k, other=0.0).to(tl.float32)
        do = tl.load(p_do, mask=mask_v, other=0.0).to(tl.float32)
        u = tl.load(p_u, mask=mask_v, other=0.0)
        beta = tl.load(p_beta).to(tl.float32)
        dstate += (scale * qt)[:, None] * do[None, :]
        du = tl.sum(dstate * kt[:, None], axis=0)
        tl.store(p_du, du, mask=mask_v)
        tl.store(p_dv, (beta * du).to(dv_ptr.dtype.element_ty), mask=mask_v)
        # dk through S_t = S_{t-1} + k_t u_t^T; the part through u_t comes in the forward pass.
        tl.store(p_dk, tl.sum(dstate * u[None, :], axis=1), mask=mask_k)
        dstate -= (beta * kt)[:, None] * du[None, :]
        p_q -= H * K
        p_k -= H * K
        p_do -= H * V
        p_dv -= H * V
        p_beta -= H
        p_dk -= H * K
        p_u -= V
        p_du -= V
    if STORE_DINIT:
        tl.store(dinit_ptr + bh64 * K * V + state_offs, dstate, mask=mask_kv)
    # The forward pass below reads back what the reverse pass wrote, from other threads.
    tl.debug_barrier()

    # Forward pass: replay the state from the initial state and the saved u rows.
    if HAS_INIT:
        state = tl.load(init_ptr + bh64 * K * V + state_offs, mask=mask_kv, other=0.0)
        state = state.to(tl.float32)
    else:
        state = tl.zeros((BK, BV), dtype=tl.float32)
    p_k = k_ptr + row * K + offs_k
    p_v = v_ptr + row * V + offs_v
    p_do = do_ptr + row * V + offs_v
    p_beta = beta_ptr + row
    p_dk = dk_part_ptr + (part + row) * K + offs_k
    p_dq = dq_part_ptr + (part + row) * K + offs_k
    p_dbeta = dbeta_part_ptr + part + row
    p_u = u_ptr + bh64 * T * V + offs_v
    p_du = du_ptr + bh64 * T * V + offs_v
    for _ in range(T):
        kt = tl.load(p_k, mask=mask_k, other=0.0).to(tl.float32)
        vt = tl.load(p_v, mask=mask_v, other=0.0).to(tl.float32)
        do = tl.load(p_do, mask=mask_v, other=0.0).to(tl.float32)
        u = tl.load(p_u, mask=mask_v, other=0.0)
        du = tl.load(p_du, mask=mask_v, other=0.0)
        dk_write = tl.load(p_dk, mask=mask_k, other=0.0)
        beta = tl.load(p_beta).to(tl.float32)
        # Masked columns hold zeros in du, v and the state: they add nothing.
        tl.store(p_dbeta, tl.sum(du * (vt - tl.sum(state * kt[:, None], axis=0)), axis=0))
        tl.store(p_dk, dk_write - beta * tl.sum(state * du[None, :], axis=1), mask=mask_k)
        state += kt[:, None] * u[None, :]
        tl.store(p_dq, tl.sum(state * do[None, :], axis=1) * scale, mask=mask_k)
        p_k += H * K
        p_v += H * V
        p_do += H * V
        p_beta += H
        p_dk += H * K
        p_dq += H * K
        p_dbeta += H
        p_u += V
        p_du += V


# ------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------


class Launch(NamedTuple):
    """Block sizes of one kernel launch: K block, V block, warps."""

    BK: int
    BV: int
    warps: int


def _split_for_parallelism(bv: int, V: int, programs: int) -> int:
    # The sequential kernels have one program per (V block, batch row, head): split V further
    # (down to 16 columns) while there are fewer than 128 programs to spread over the GPU.
    while bv > 16 and triton.cdiv(V, bv) * programs < 128:
        bv //= 2
    return bv


def recurrent_launch(K: int, V: int, programs: int) -> Launch:
    """The fused recurrent kernels: a (BK, BV) float32 state tile of at most 4096 floats."""
    BK = _pow2(K)
    bv = _split_for_parallelism(min(_pow2(V), max(16, 4096 // BK)), V, programs)
    return Launch(BK, bv, 8 if BK * bv >= 4096 else 4)


def state_launch(K: int, V: int, dtype: torch.dtype, programs: int) -> Launch:
    """`_chunk_state_fwd_kernel` and `_chunk_state_bwd_kernel`: the whole K in one tile, so V
    blocks stay narrow (no register spills on sm_90 up to K = 128 in fp16/bf16)."""
    BK = _pow2(K)
    bv = 32 if BK <= 32 and dtype != torch.float32 else 16
    bv = _split_for_parallelism(min(_pow2(V), bv), V, programs)
    return Launch(BK, bv, 4 if BK <= 32 else 8)


def output_launch(K: int, V: int, dtype: torch.dtype) -> Launch:
    """`_chunk_output_kernel`: parallel over chunks, so wider V blocks."""
    BK = _pow2(K)
    warps = 8 if BK >= 64 else 4
    if dtype == torch.float32:
        return Launch(BK, min(_pow2(V), 32 if BK <= 64 else 16), warps)
    return Launch(BK, min(_pow2(V), 64 if BK <= 128 else 32), warps)


def grad_launch(K: int, V: int, dtype: torch.dtype) -> Launch:
    """`_chunk_grad_kernel`: two (C, C) and three (C, BK) float32 accumulators, so small tiles
    and single-stage loads."""
    return Launch(min(_pow2(K), 32), 16, 4)


INVERSE_WARPS = 4


def _empty(like: torch.Tensor, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An unfilled buffer on `like`'s device (in its dtype by default). Every buffer the host
    code allocates goes through torch.empty / torch.empty_like, so that a test can make them
    start as NaN and catch a kernel that reads what nothing wrote."""
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def empty_saved(
    q: torch.Tensor, v: torch.Tensor, kernel: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward's saved buffers (u rows, chunk start states, chunk inverses), unfilled.

    u (B, H, T, V) and, for the chunked kernels, h (B, H, NT, K, V) in float32, and A
    (B, H, NT, C, C) in float32 for float32 inputs, else in the inputs' dtype (it only ever
    enters tl.dot as a half-precision operand). The recurrent kernel saves u only; the other
    two are then empty placeholders.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    f32 = torch.float32
    u = _empty(q, B, H, T, V, dtype=f32)
    if kernel == "recurrent":
        return u, _empty(q, 0, dtype=f32), _empty(q, 0, dtype=f32)
    C = chunk_size(K, q.dtype)
    NT = triton.cdiv(T, C)
    a_dtype = f32 if q.dtype == f32 else q.dtype
    return u, _empty(q, B, H, NT, K, V, dtype=f32), _empty(q, B, H, NT, C, C, dtype=a_dtype)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    kernel: str,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """o (B, T, H, V) in q's dtype, the final state (B, H, K, V) float32 or None, and the
    buffers the backward needs (see `empty_saved`). `kernel`: "chunked" or "recurrent"."""
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    init = None if initial_state is None else initial_state.contiguous()
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = _empty(q, B, T, H, V)
    final = _empty(q, B, H, K, V, dtype=torch.float32) if output_final_state else None
    saved = empty_saved(q, v, kernel)
    if B == 0:
        return o, final, saved
    u, h, a = saved
    # Absent optional tensors: any valid pointer, never read (the flags are compile-time).
    init_arg = init if init is not None else o
    final_arg = final if final is not None else o
    flags = dict(HAS_INIT=init is not None, STORE_FINAL=final is not None)
    if kernel == "recurrent":
        BK, BV, warps = recurrent_launch(K, V, B * H)
        _recurrent_fwd_kernel[(triton.cdiv(V, BV), B * H)](
            q, k, v, beta, init_arg, o, u, final_arg, scale, T, H, K, V,
            BK=BK, BV=BV, **flags, num_warps=warps,
        )  # fmt: skip
        return o, final, saved
    C = chunk_size(K, q.dtype)
    NT = triton.cdiv(T, C)
    ieee = q.dtype == torch.float32
    _chunk_inverse_kernel[(NT, B * H)](
        k, beta, a, T, H, K, NT,
        C=C, SB=SUB_BLOCK, BK=min(_pow2(K), 64), IEEE=ieee, num_warps=INVERSE_WARPS,
    )  # fmt: skip
    BK, BV, warps = state_launch(K, V, q.dtype, B * H)
    _chunk_state_fwd_kernel[(triton.cdiv(V, BV), B * H)](
        k, v, beta, a, init_arg, h, u, final_arg, T, H, K, V, NT,
        C=C, BK=BK, BV=BV, **flags, IEEE=ieee, num_warps=warps,
    )  # fmt: skip
    BK, BV, warps = output_launch(K, V, q.dtype)
    _chunk_output_kernel[(triton.cdiv(V, BV), NT, B * H)](
        q, k, h, u, o, scale, T, H, K, V, NT,
        C=C, BK=BK, BV=BV, IEEE=ieee, num_warps=warps,
    )  # fmt: skip
    return o, final, saved


def backward(
    do: torch.Tensor,
    dfinal: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    saved: tuple[torch.Tensor, ...],
    kernel: str,
) -> list[torch.Tensor | None]:
    """Gradients (dq, dk, dv, dbeta, dinitial_state), None for an absent initial_state;
    `dfinal` is the final state's gradient, or None when the final state was not an output."""
    q, k, v, beta, do = (t.contiguous() for t in (q, k, v, beta, do))
    init = None if initial_state is None else initial_state.contiguous()
    dfinal = None if dfinal is None else dfinal.contiguous()
    B, T, H, K = q.shape
    V = v.shape[-1]
    u, h, a = saved
    f32 = torch.float32
    dv = torch.empty_like(v)
    dinit = None if init is None else _empty(q, B, H, K, V, dtype=f32)
    if B == 0:
        return [torch.zeros_like(q), torch.zeros_like(k), dv, torch.zeros_like(beta), dinit]
    dinit_arg = dinit if dinit is not None else dv
    dfinal_arg = dfinal if dfinal is not None else dv
    if kernel == "recurrent":
        BK, BV, warps = recurrent_launch(K, V, B * H)
        NV = triton.cdiv(V, BV)
        dq_part = _empty(q, NV, B, T, H, K, dtype=f32)
        dk_part = _empty(q, NV, B, T, H, K, dtype=f32)
        dbeta_part = _empty(q, NV, B, T, H, dtype=f32)
        du = _empty(q, B, H, T, V, dtype=f32)
        _recurrent_bwd_kernel[(NV, B * H)](
            q, k, v, beta, init if init is not None else dv, u, do, dfinal_arg, du,
            dq_part, dk_part, dv, dbeta_part, dinit_arg, scale, B, T, H, K, V,
            BK=BK, BV=BV, HAS_INIT=init is not None, HAS_DFINAL=dfinal is not None,
            STORE_DINIT=dinit is not None, num_warps=warps,
        )  # fmt: skip
        # Fixed-order sums over the V blocks: deterministic.
        dq = dq_part.sum(0).to(q.dtype)
        dk = dk_part.sum(0).to(k.dtype)
        dbeta = dbeta_part.sum(0).to(beta.dtype)
        return [dq, dk, dv, dbeta, dinit]
    C = chunk_size(K, q.dtype)
    NT = triton.cdiv(T, C)
    ieee = q.dtype == torch.float32
    dh = torch.empty_like(h)
    dr = torch.empty_like(u)
    BK, BV, warps = state_launch(K, V, q.dtype, B * H)
    _chunk_state_bwd_kernel[(triton.cdiv(V, BV), B * H)](
        q, k, beta, a, do, dfinal_arg, dh, dr, dinit_arg, scale, T, H, K, V, NT,
        C=C, BK=BK, BV=BV, HAS_DFINAL=dfinal is not None, STORE_DINIT=dinit is not None,
        IEEE=ieee, num_warps=warps,
    )  # fmt: skip
    BK, BV, warps = grad_launch(K, V, q.dtype)
    NK = triton.cdiv(K, BK)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dbeta_part = _empty(q, NK, B, T, H, dtype=f32)
    _chunk_grad_kernel[(NK, NT, B * H)](
        q, k, v, beta, h, dh, u, dr, do, dq, dk, dv, dbeta_part, scale, B, T, H, K, V, NT,
        C=C, BK=BK, BV=BV, IEEE=ieee, num_warps=warps, num_stages=1,
    )  # fmt: skip
    dbeta = dbeta_part.sum(0).to(beta.dtype)  # fixed-order sum over the K blocks
    return [dq, dk, dv, dbeta, dinit]


# Pointers to float32 buffers whatever the input dtype (states, u rows, partial sums).
_FLOAT32_POINTERS = {
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
}


def _launches(K: int, V: int, dtype: torch.dtype, programs: int = 64) -> list[tuple]:
    """(kernel, constexprs, num_warps, num_stages) for every launch of forward/backward."""
    C = chunk_size(K, dtype)
    ieee = dtype == torch.float32
    rec = recurrent_launch(K, V, programs)
    state = state_launch(K, V, dtype, programs)
    out = output_launch(K, V, dtype)
    grad = grad_launch(K, V, dtype)
    both = dict(HAS_INIT=True, STORE_FINAL=True)
    return [
        (
            _chunk_inverse_kernel,
            dict(C=C, SB=SUB_BLOCK, BK=min(_pow2(K), 64), IEEE=ieee),
            INVERSE_WARPS,
            None,
        ),
        (
            _chunk_state_fwd_kernel,
            dict(C=C, BK=state.BK, BV=state.BV, **both, IEEE=ieee),
            state.warps,
            None,
        ),
        (
            _chunk_output_kernel,
            dict(C=C, BK=out.BK, BV=out.BV, IEEE=ieee),
            out.warps,
            None,
        ),
        (
            _chunk_state_bwd_kernel,
            dict(C=C, BK=state.BK, BV=state.BV, HAS_DFINAL=True, STORE_DINIT=True, IEEE=ieee),
            state.warps,
            None,
        ),
        (
            _chunk_grad_kernel,
            dict(C=C, BK=grad.BK, BV=grad.BV, IEEE=ieee),
            grad.warps,
            1,
        ),
        (_recurrent_fwd_kernel, dict(BK=rec.BK, BV=rec.BV, **both), rec.warps, None),
        (
            _recurrent_bwd_kernel,
            dict(BK=rec.BK, BV=rec.BV, HAS_INIT=True, HAS_DFINAL=True, STORE_DINIT=True),
            rec.warps,
            None,
        ),
    ]


def hopper_specialisations() -> list:
    """The launch configurations to compile-check for sm_90 (see kernels.compile_check): every
    kernel as the host code launches it, at the benchmark's head size in bf16, a padded head
    (K=100, V=36) in fp16 and the largest head in fp32 (the most shared memory). None may use
    wgmma (see `chunk_size`)."""
    from kernels.compile_check import Specialisation

    specs = []
    for K, V, dtype in (
        (128, 128, torch.bfloat16),
        (100, 36, torch.float16),
        (256, 256, torch.float32),
    ):
        for kernel, constants, warps, stages in _launches(K, V, dtype):
            specs.append(
                Specialisation(
                    kernel,
                    constants,
                    dtype,
                    warps=warps,
                    stages=stages,
                    float32_pointers=frozenset(_FLOAT32_POINTERS),
                    float_scalars=frozenset({"scale"}),
                    allow_wgmma=False,
                )
            )
    return specs
