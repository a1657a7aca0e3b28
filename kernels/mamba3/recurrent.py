"""Triton kernels of Mamba-3's core recurrence (mecheval_kernels.mamba3.core), one step at a time
with the state tile on chip, the state's P rows split over programs (each row evolves on its own:
the decay is a scalar and the writes are rank one in it).

`core_fwd_kernel`  grid (P blocks, B*H): per step h = exp(a) h + s sum_r v_r k_r^T, then
    y_r = h q_r for each rank r; stores the state at the start of every chunk of C steps (the
    checkpoints the backward replays from) and the final state.
`core_bwd_kernel`  grid (P blocks, B*H): chunks in reverse; each chunk's states are replayed from
    its checkpoint into the program's scratch tiles, then its steps run in reverse:
        dh += sum_r dy_r q_r^T ; dq_r = h_t^T dy_r ; dv_r = s dh k_r ; dk_r = s dh^T v_r ;
        ds = sum_r v_r^T dh k_r ; da = exp(a) <h_{t-1}, dh> ; dh <- exp(a) dh
    Gradients that sum over P (dq, dk, ds, da) are written per P block and summed on the host in
    a fixed order (deterministic); dv and the initial state's gradient directly.

Layouts (contiguous): q, k (B, L, R, H, N); v, y (B, L, R, H, P); a, s (B, L, H); states
(B, H, P, N). A tl.debug_barrier() separates each replay from the reverse pass that reads it,
and that pass from the next replay (they share scratch tiles across threads).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(pid_p, P, N, BP: tl.constexpr, BN: tl.constexpr):
    """The (BP, BN) state tile of P block pid_p: (offs_p, offs_n, mask_p, mask_n, offsets in a
    (P, N) state, their mask)."""
    offs_p = pid_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mask_p, mask_n = offs_p < P, offs_n < N
    return (offs_p, offs_n, mask_p, mask_n, offs_p[:, None] * N + offs_n[None, :],
            mask_p[:, None] & mask_n[None, :])  # fmt: skip


@triton.jit
def core_fwd_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, s_ptr, init_ptr, y_ptr, h_ptr, final_ptr,
    L, H, N, P, NT,
    R: tl.constexpr, C: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_INIT: tl.constexpr, STORE_FINAL: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(1)
    offs_p, offs_n, mask_p, mask_n, state_offs, mask_pn = _tile(tl.program_id(0), P, N, BP, BN)
    b, h = (bh // H).to(tl.int64), bh % H
    bh64 = bh.to(tl.int64)
    if HAS_INIT:
        state = tl.load(init_ptr + bh64 * P * N + state_offs, mask=mask_pn, other=0.0)
    else:
        state = tl.zeros((BP, BN), dtype=tl.float32)
    for t in range(L):
        if t % C == 0:
            tl.store(h_ptr + (bh64 * NT + t // C) * P * N + state_offs, state, mask=mask_pn)
        step = (b * L + t) * H + h
        decay = tl.exp(tl.load(a_ptr + step).to(tl.float32))
        scale = tl.load(s_ptr + step).to(tl.float32)
        state = decay * state
        for r in tl.static_range(R):
            row = (b * L + t) * R * H + r * H + h
            kt = tl.load(k_ptr + row * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            vt = tl.load(v_ptr + row * P + offs_p, mask=mask_p, other=0.0).to(tl.float32)
            state += (scale * vt)[:, None] * kt[None, :]
        for r in tl.static_range(R):
            row = (b * L + t) * R * H + r * H + h
            qt = tl.load(q_ptr + row * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            y = tl.sum(state * qt[None, :], axis=1)
            tl.store(y_ptr + row * P + offs_p, y.to(y_ptr.dtype.element_ty), mask=mask_p)
    if STORE_FINAL:
        tl.store(final_ptr + bh64 * P * N + state_offs, state, mask=mask_pn)


@triton.jit
def _replay(k_ptr, v_ptr, a_ptr, s_ptr, h_ptr, scratch, tile, bh64, b, h, c, steps, L, H, N, P,
            NT, offs_p, offs_n, mask_p, mask_n, state_offs, mask_pn,
            R: tl.constexpr, C: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """Chunk c's states into the scratch tiles: slot 0 its checkpoint, slot j + 1 the state after
    its step j."""
    state = tl.load(h_ptr + (bh64 * NT + c) * P * N + state_offs, mask=mask_pn, other=0.0)
    tl.store(scratch + tile, state)
    for j in range(steps):
        t = c * C + j
        step = (b * L + t) * H + h
        state = tl.exp(tl.load(a_ptr + step).to(tl.float32)) * state
        scale = tl.load(s_ptr + step).to(tl.float32)
        for r in tl.static_range(R):
            row = (b * L + t) * R * H + r * H + h
            kt = tl.load(k_ptr + row * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            vt = tl.load(v_ptr + row * P + offs_p, mask=mask_p, other=0.0).to(tl.float32)
            state += (scale * vt)[:, None] * kt[None, :]
        tl.store(scratch + (j + 1) * BP * BN + tile, state)


@triton.jit
def core_bwd_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, s_ptr, h_ptr, dy_ptr, dfinal_ptr, scratch_ptr,
    dq_part_ptr, dk_part_ptr, ds_part_ptr, da_part_ptr, dv_ptr, dinit_ptr,
    B, L, H, N, P, NT,
    R: tl.constexpr, C: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_DFINAL: tl.constexpr, STORE_DINIT: tl.constexpr,
):  # fmt: skip
    pid_p = tl.program_id(0)
    bh = tl.program_id(1)
    offs_p, offs_n, mask_p, mask_n, state_offs, mask_pn = _tile(pid_p, P, N, BP, BN)
    b, h = (bh // H).to(tl.int64), bh % H
    bh64 = bh.to(tl.int64)
    if HAS_DFINAL:
        dstate = tl.load(dfinal_ptr + bh64 * P * N + state_offs, mask=mask_pn, other=0.0)
    else:
        dstate = tl.zeros((BP, BN), dtype=tl.float32)
    part = pid_p.to(tl.int64) * B * L  # this P block's slice of the (NP, B, L, ...) partials
    scratch = scratch_ptr + (bh64 * tl.num_programs(0) + pid_p) * (C + 1) * BP * BN
    tile = tl.arange(0, BP)[:, None] * BN + tl.arange(0, BN)[None, :]
    for i in range(NT):
        c = NT - 1 - i
        steps = tl.minimum(C, L - c * C)
        _replay(k_ptr, v_ptr, a_ptr, s_ptr, h_ptr, scratch, tile, bh64, b, h, c, steps, L, H,
                N, P, NT, offs_p, offs_n, mask_p, mask_n, state_offs, mask_pn, R, C, BP,
                BN)  # fmt: skip
        tl.debug_barrier()  # the reverse pass reads what the replay stored, from other threads
        for jj in range(steps):
            j = steps - 1 - jj
            t = c * C + j
            step = (b * L + t) * H + h
            decay = tl.exp(tl.load(a_ptr + step).to(tl.float32))
            scale = tl.load(s_ptr + step).to(tl.float32)
            after = tl.load(scratch + (j + 1) * BP * BN + tile)
            before = tl.load(scratch + j * BP * BN + tile)
            for r in tl.static_range(R):
                row = (b * L + t) * R * H + r * H + h
                qt = tl.load(q_ptr + row * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * P + offs_p, mask=mask_p, other=0.0).to(tl.float32)
                dstate += dy[:, None] * qt[None, :]
                dq = tl.sum(after * dy[:, None], axis=0)
                tl.store(dq_part_ptr + (part * R * H + row) * N + offs_n, dq, mask=mask_n)
            ds = 0.0
            for r in tl.static_range(R):
                row = (b * L + t) * R * H + r * H + h
                kt = tl.load(k_ptr + row * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                vt = tl.load(v_ptr + row * P + offs_p, mask=mask_p, other=0.0).to(tl.float32)
                dh_k = tl.sum(dstate * kt[None, :], axis=1)  # (BP,)
                ds += tl.sum(dh_k * vt, axis=0)
                tl.store(dv_ptr + row * P + offs_p, (scale * dh_k).to(dv_ptr.dtype.element_ty),
                         mask=mask_p)  # fmt: skip
                dk = scale * tl.sum(dstate * vt[:, None], axis=0)
                tl.store(dk_part_ptr + (part * R * H + row) * N + offs_n, dk, mask=mask_n)
            tl.store(ds_part_ptr + part * H + step, ds)
            tl.store(da_part_ptr + part * H + step, decay * tl.sum(tl.sum(before * dstate, 1), 0))
            dstate = decay * dstate
        tl.debug_barrier()  # the next replay overwrites the tiles this pass read
    if STORE_DINIT:
        tl.store(dinit_ptr + bh64 * P * N + state_offs, dstate, mask=mask_pn)
