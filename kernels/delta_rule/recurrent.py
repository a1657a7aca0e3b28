"""Triton kernels of the delta rule's fused recurrence (short sequences, single-step decoding).

`recurrent_fwd_kernel`: grid (V blocks, B*H), one step at a time with the state tile on chip;
saves the u_t rows. `recurrent_bwd_kernel` runs a reverse pass (gradient of the state, dv, du,
the first part of dk) and then a forward pass that replays the state from the initial state and
the saved u rows (dq, the rest of dk, dbeta); gradients that sum over V are written per V block
and summed on the host in a fixed order.

The backward is the only kernel that reads global memory written in the same launch (its
forward pass reads the du rows and dk partials that its reverse pass stored, in other threads'
layouts), with a tl.debug_barrier() between the passes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mecheval_kernels.delta_rule.common import load_state, state_tile


@triton.jit
def recurrent_fwd_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, init_ptr, o_ptr, u_ptr, final_ptr,
    scale, T, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr, HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1)
    offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv = state_tile(tl.program_id(0), K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    state = load_state(init_ptr, bh64, K, V, state_offs, mask_kv, HAS_INIT, BK, BV)
    # Pointers at step 0, advanced by one step (H rows of the (B, T, H, .) layout) per step.
    row = (bh // H).to(tl.int64) * T * H + bh % H
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
def recurrent_bwd_kernel(
    q_ptr, k_ptr, v_ptr, beta_ptr, init_ptr, u_ptr, do_ptr, dfinal_ptr, du_ptr,
    dq_part_ptr, dk_part_ptr, dv_ptr, dbeta_part_ptr, dinit_ptr,
    scale, B, T, H, K, V,
    BK: tl.constexpr, BV: tl.constexpr,
    HAS_INIT: tl.constexpr, HAS_DFINAL: tl.constexpr, STORE_DINIT: tl.constexpr,
):  # fmt: skip
    pid_v = tl.program_id(0)
    bh = tl.program_id(1)
    offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv = state_tile(pid_v, K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    # This V block's slice of the partial sums over V blocks: (NV, B, T, H, .).
    part = pid_v.to(tl.int64) * B * T * H
    row = (bh // H).to(tl.int64) * T * H + bh % H  # (b, 0, h)
    last = row + (T - 1) * H  # (b, T - 1, h)

    # Reverse pass: the state's gradient, and what needs no state.
    dstate = load_state(dfinal_ptr, bh64, K, V, state_offs, mask_kv, HAS_DFINAL, BK, BV)
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
    state = load_state(init_ptr, bh64, K, V, state_offs, mask_kv, HAS_INIT, BK, BV)
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
