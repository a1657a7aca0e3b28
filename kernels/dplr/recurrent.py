"""Triton kernels of the DPLR delta rule: its recurrence one step at a time with the state tile
on chip (notation in reference.py), the V columns of the state split over programs (each column
evolves on its own: the transition acts on the key rows).

`dplr_fwd_kernel`  grid (V blocks, B*H): per step u = S^T a, S = exp(gk) * S + b u^T + k v^T,
    o = S^T (scale q); stores the state at the start of every chunk of C steps (the
    checkpoints the backward replays from) and the final state.
`dplr_bwd_kernel`  grid (V blocks, B*H): chunks in reverse; for each, the states of its C steps
    are replayed from its checkpoint into the program's scratch tiles, then its steps run in
    reverse:
        dS += scale q do^T ; dq = scale S_t do ; dk = dS v ; dv = dS^T k ; db = dS u ;
        du = dS^T b ; da = S_{t-1} du ; dgk = exp(gk) * rowsum(S_{t-1} * dS) ;
        dS <- exp(gk) * dS + a du^T         (the gradient of S_{t-1})
    Gradients that sum over V (dq, dk, da, db, dgk) are written per V block and summed on the
    host in a fixed order (deterministic); dv and the initial state's gradient directly.

The backward reads back, from other threads, the scratch tiles it wrote in the same launch:
a tl.debug_barrier() separates each replay from the reverse pass over it, and that pass from
the next replay.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mecheval_kernels.delta_rule.common import load_state, state_tile


@triton.jit
def _step_rows(q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, row, offs_k, mask_k, K):
    """The step's q, k, a, b and exp(gk) rows (K,) in float32 (zeros, and decay 1, past K)."""
    qt = tl.load(q_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    kt = tl.load(k_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    at = tl.load(a_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    bt = tl.load(b_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + row * K + offs_k, mask=mask_k, other=0.0).to(tl.float32))
    return qt, kt, at, bt, decay


@triton.jit
def dplr_fwd_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, g_ptr, init_ptr, o_ptr, h_ptr, final_ptr,
    scale, T, H, K, V, NT,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1)
    offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv = state_tile(tl.program_id(0), K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    state = load_state(init_ptr, bh64, K, V, state_offs, mask_kv, HAS_INIT, BK, BV)
    base = (bh // H).to(tl.int64) * T * H + bh % H  # the (b, 0, h) row
    for t in range(T):
        if t % C == 0:
            tl.store(h_ptr + (bh64 * NT + t // C) * K * V + state_offs, state, mask=mask_kv)
        row = base + t * H
        qt, kt, at, bt, decay = _step_rows(
            q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, row, offs_k, mask_k, K
        )
        vt = tl.load(v_ptr + row * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        u = tl.sum(at[:, None] * state, axis=0)
        state = decay[:, None] * state + bt[:, None] * u[None, :] + kt[:, None] * vt[None, :]
        o = tl.sum(qt[:, None] * state, axis=0) * scale
        tl.store(o_ptr + row * V + offs_v, o.to(o_ptr.dtype.element_ty), mask=mask_v)
    if STORE_FINAL:
        tl.store(final_ptr + bh64 * K * V + state_offs, state, mask=mask_kv)


@triton.jit
def _replay(
    k_ptr, v_ptr, a_ptr, b_ptr, g_ptr, h_ptr, scratch, bh64, base, c, steps, H, K, V, NT,
    offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv, tile,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    """Chunk c's states into the scratch tiles: slot 0 its checkpoint, slot j + 1 the state
    after its step j."""
    state = tl.load(h_ptr + (bh64 * NT + c) * K * V + state_offs, mask=mask_kv, other=0.0)
    tl.store(scratch + tile, state)
    for j in range(steps):
        row = base + (c * C + j) * H
        _, kt, at, bt, decay = _step_rows(k_ptr, k_ptr, a_ptr, b_ptr, g_ptr, row, offs_k, mask_k, K)
        vt = tl.load(v_ptr + row * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        u = tl.sum(at[:, None] * state, axis=0)
        state = decay[:, None] * state + bt[:, None] * u[None, :] + kt[:, None] * vt[None, :]
        tl.store(scratch + (j + 1) * BK * BV + tile, state)


@triton.jit
def dplr_bwd_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, g_ptr, h_ptr, do_ptr, dfinal_ptr, scratch_ptr,
    dq_part_ptr, dk_part_ptr, da_part_ptr, db_part_ptr, dg_part_ptr, dv_ptr, dinit_ptr,
    scale, B, T, H, K, V, NT,
    C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DFINAL: tl.constexpr, STORE_DINIT: tl.constexpr,
):  # fmt: skip
    pid_v = tl.program_id(0)
    bh = tl.program_id(1)
    offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv = state_tile(pid_v, K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    dstate = load_state(dfinal_ptr, bh64, K, V, state_offs, mask_kv, HAS_DFINAL, BK, BV)
    base = (bh // H).to(tl.int64) * T * H + bh % H
    part = pid_v.to(tl.int64) * B * T * H  # this V block's slice of the (NV, B, T, H, .) partials
    # This program's (C + 1) scratch tiles, each a dense (BK, BV) block.
    scratch = scratch_ptr + (bh64 * tl.num_programs(0) + pid_v) * (C + 1) * BK * BV
    tile = tl.arange(0, BK)[:, None] * BV + tl.arange(0, BV)[None, :]
    for i in range(NT):
        c = NT - 1 - i
        steps = tl.minimum(C, T - c * C)
        _replay(
            k_ptr, v_ptr, a_ptr, b_ptr, g_ptr, h_ptr, scratch, bh64, base, c, steps, H, K, V, NT,
            offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv, tile, C, BK, BV,
        )  # fmt: skip
        tl.debug_barrier()  # the reverse pass reads what the replay stored, from other threads
        for jj in range(steps):
            j = steps - 1 - jj
            row = base + (c * C + j) * H
            qt, kt, at, bt, decay = _step_rows(
                q_ptr, k_ptr, a_ptr, b_ptr, g_ptr, row, offs_k, mask_k, K
            )
            vt = tl.load(v_ptr + row * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
            do = tl.load(do_ptr + row * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
            after = tl.load(scratch + (j + 1) * BK * BV + tile)
            before = tl.load(scratch + j * BK * BV + tile)
            dstate += (scale * qt)[:, None] * do[None, :]
            u = tl.sum(at[:, None] * before, axis=0)
            du = tl.sum(dstate * bt[:, None], axis=0)
            p_row = (part + row) * K + offs_k
            tl.store(dq_part_ptr + p_row, tl.sum(after * do[None, :], axis=1) * scale, mask=mask_k)
            tl.store(dk_part_ptr + p_row, tl.sum(dstate * vt[None, :], axis=1), mask=mask_k)
            tl.store(db_part_ptr + p_row, tl.sum(dstate * u[None, :], axis=1), mask=mask_k)
            tl.store(da_part_ptr + p_row, tl.sum(before * du[None, :], axis=1), mask=mask_k)
            tl.store(dg_part_ptr + p_row, decay * tl.sum(before * dstate, axis=1), mask=mask_k)
            dv = tl.sum(dstate * kt[:, None], axis=0)
            tl.store(dv_ptr + row * V + offs_v, dv.to(dv_ptr.dtype.element_ty), mask=mask_v)
            dstate = decay[:, None] * dstate + at[:, None] * du[None, :]
        tl.debug_barrier()  # the next replay overwrites the tiles this pass read
    if STORE_DINIT:
        tl.store(dinit_ptr + bh64 * K * V + state_offs, dstate, mask=mask_kv)
