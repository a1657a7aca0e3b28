"""Triton backward of the short causal depthwise convolution.

It recomputes the pre-activation instead of saving it, and produces per-tile partial sums of
dweight and dbias that the host reduces in a fixed order: no atomics, so gradients are bitwise
reproducible.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mecheval_kernels.short_conv.forward import load_padded, pre_activation


@triton.jit
def conv_bwd_kernel(
    x_ptr, w_ptr, b_ptr, init_ptr, D, L,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_ww, stride_ib, stride_id, stride_iw,
    dy_ptr, dx_ptr, dinit_ptr, dw_part_ptr, db_part_ptr, NUM_L_BLOCKS,
    stride_dyb, stride_dyd, stride_dyl, stride_dxb, stride_dxd, stride_dxl,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    # Positions s run over [-(W - 1), L): s < 0 are the initial states' gradients.
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_s = pid_l * BLOCK_L - (W - 1) + tl.arange(0, BLOCK_L)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    x_ptr += pid_b.to(tl.int64) * stride_xb
    init_ptr += pid_b.to(tl.int64) * stride_ib
    dy_ptr += pid_b.to(tl.int64) * stride_dyb

    dx = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    # dx[s] = sum_k weight[W - 1 - k] * g[s + k], g the gradient of the pre-activation.
    for k in range(W):
        t = offs_s + k
        in_t = (t >= 0) & (t < L)
        g = tl.load(
            dy_ptr + offs_d[:, None] * stride_dyd + t[None, :] * stride_dyl,
            mask=mask_d[:, None] & in_t[None, :],
            other=0.0,
        ).to(tl.float32)
        if SILU:
            pre = pre_activation(x_ptr, init_ptr, w_ptr, b_ptr, t, offs_d, mask_d, L,
                                 stride_xd, stride_xl, stride_id, stride_iw, stride_wd, stride_ww,
                                 W, HAS_BIAS, HAS_INIT, BLOCK_D, BLOCK_L)  # fmt: skip
            sig = tl.sigmoid(pre)
            g = g * sig * (1.0 + pre * (1.0 - sig))
        wv = tl.load(w_ptr + offs_d * stride_wd + (W - 1 - k) * stride_ww, mask=mask_d, other=0.0)
        dx += wv.to(tl.float32)[:, None] * g
        if k == 0:
            # This tile's g[s] for s in [0, L) partitions the positions exactly once across
            # tiles: the partial sums of dweight and dbias come from here.
            part = pid_b * NUM_L_BLOCKS + pid_l
            for w in range(W):
                xv = load_padded(x_ptr, init_ptr, offs_s - (W - 1) + w, offs_d, mask_d, L,
                                 stride_xd, stride_xl, stride_id, stride_iw,
                                 W, HAS_INIT)  # fmt: skip
                tl.store(
                    dw_part_ptr + (part * D + offs_d) * W + w, tl.sum(g * xv, axis=1), mask=mask_d
                )
            if HAS_BIAS:
                tl.store(db_part_ptr + part * D + offs_d, tl.sum(g, axis=1), mask=mask_d)

    in_x = (offs_s >= 0) & (offs_s < L)
    dx_ptrs = (
        dx_ptr
        + pid_b.to(tl.int64) * stride_dxb
        + offs_d[:, None] * stride_dxd
        + offs_s[None, :] * stride_dxl
    )
    tl.store(dx_ptrs, dx.to(dx_ptr.dtype.element_ty), mask=mask_d[:, None] & in_x[None, :])
    if HAS_INIT:
        in_init = (offs_s < 0) & (offs_s >= 1 - W)
        di_ptrs = (
            dinit_ptr
            + pid_b.to(tl.int64) * (D * (W - 1))
            + offs_d[:, None] * (W - 1)
            + (offs_s + W - 1)[None, :]
        )
        tl.store(
            di_ptrs, dx.to(dinit_ptr.dtype.element_ty), mask=mask_d[:, None] & in_init[None, :]
        )
