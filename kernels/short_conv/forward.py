"""Triton forward of the short causal depthwise convolution, and the tile loads it shares with
the backward.

Each program owns a (BLOCK_D channels) x (BLOCK_L positions) tile of one batch row and loops
over the W taps (a rolled loop: unrolled, the shifted tiles all stay live and spill
registers); inputs before position 0 come from `initial_states` (or are zero). Accumulation
is in float32. Strides are passed explicitly, so a (B, L, D) tensor viewed as (B, D, L) is
read in place.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_padded(
    x_ptr, init_ptr, pos, offs_d, mask_d, L, stride_xd, stride_xl, stride_id, stride_iw,
    W: tl.constexpr, HAS_INIT: tl.constexpr,
):  # fmt: skip
    """Inputs at positions `pos` (may be negative) as float32, (BLOCK_D, BLOCK_L)."""
    in_x = (pos >= 0) & (pos < L)
    x_ptrs = x_ptr + offs_d[:, None] * stride_xd + pos[None, :] * stride_xl
    vals = tl.load(x_ptrs, mask=mask_d[:, None] & in_x[None, :], other=0.0).to(tl.float32)
    if HAS_INIT:
        in_init = (pos < 0) & (pos >= 1 - W)
        i_ptrs = init_ptr + offs_d[:, None] * stride_id + (pos + W - 1)[None, :] * stride_iw
        vals += tl.load(i_ptrs, mask=mask_d[:, None] & in_init[None, :], other=0.0).to(tl.float32)
    return vals


@triton.jit
def pre_activation(
    x_ptr, init_ptr, w_ptr, b_ptr, pos, offs_d, mask_d, L,
    stride_xd, stride_xl, stride_id, stride_iw, stride_wd, stride_ww,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """bias + the convolution at positions `pos`, (BLOCK_D, BLOCK_L) float32."""
    acc = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    for w in range(W):
        xv = load_padded(x_ptr, init_ptr, pos - (W - 1) + w, offs_d, mask_d, L,
                         stride_xd, stride_xl, stride_id, stride_iw, W, HAS_INIT)  # fmt: skip
        wv = tl.load(w_ptr + offs_d * stride_wd + w * stride_ww, mask=mask_d, other=0.0)
        acc += wv.to(tl.float32)[:, None] * xv
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def conv_fwd_kernel(
    x_ptr, w_ptr, b_ptr, init_ptr, D, L,
    stride_xb, stride_xd, stride_xl, stride_wd, stride_ww, stride_ib, stride_id, stride_iw,
    y_ptr, stride_yb, stride_yd, stride_yl,
    W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_INIT: tl.constexpr, SILU: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    x_ptr += pid_b.to(tl.int64) * stride_xb
    init_ptr += pid_b.to(tl.int64) * stride_ib
    acc = pre_activation(x_ptr, init_ptr, w_ptr, b_ptr, offs_l, offs_d, mask_d, L,
                         stride_xd, stride_xl, stride_id, stride_iw, stride_wd, stride_ww,
                         W, HAS_BIAS, HAS_INIT, BLOCK_D, BLOCK_L)  # fmt: skip
    if SILU:
        acc = acc * tl.sigmoid(acc)
    y_ptrs = (
        y_ptr
        + pid_b.to(tl.int64) * stride_yb
        + offs_d[:, None] * stride_yd
        + offs_l[None, :] * stride_yl
    )
    mask = mask_d[:, None] & (offs_l < L)[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
