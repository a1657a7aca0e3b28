"""Triton forward and backward of the short causal depthwise convolution.

Each program owns a (BLOCK_D channels) x (BLOCK_L positions) tile of one batch row and loops
over the W taps (a rolled loop: unrolled, the shifted tiles all stay live and spill
registers); inputs before position 0 come from `initial_states` (or are zero).
Accumulation is in float32. Strides are passed explicitly, so a (B, L, D) tensor viewed as
(B, D, L) is read in place.

The backward recomputes the pre-activation instead of saving it, and produces per-tile partial
sums of dweight and dbias that the host reduces in a fixed order: no atomics, so gradients are
bitwise reproducible.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _load_padded(
    x_ptr,
    init_ptr,
    pos,
    offs_d,
    mask_d,
    L,
    stride_xd,
    stride_xl,
    stride_id,
    stride_iw,
    W: tl.constexpr,
    HAS_INIT: tl.constexpr,
):
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
def _pre_activation(
    x_ptr,
    init_ptr,
    w_ptr,
    b_ptr,
    pos,
    offs_d,
    mask_d,
    L,
    stride_xd,
    stride_xl,
    stride_id,
    stride_iw,
    stride_wd,
    stride_ww,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    acc = tl.zeros((BLOCK_D, BLOCK_L), dtype=tl.float32)
    for w in range(W):
        xv = _load_padded(
            x_ptr,
            init_ptr,
            pos - (W - 1) + w,
            offs_d,
            mask_d,
            L,
            stride_xd,
            stride_xl,
            stride_id,
            stride_iw,
            W,
            HAS_INIT,
        )
        wv = tl.load(w_ptr + offs_d * stride_wd + w * stride_ww, mask=mask_d, other=0.0)
        acc += wv.to(tl.float32)[:, None] * xv
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[:, None]
    return acc


@triton.jit
def _conv_fwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    init_ptr,
    y_ptr,
    D,
    L,
    stride_xb,
    stride_xd,
    stride_xl,
    stride_wd,
    stride_ww,
    stride_ib,
    stride_id,
    stride_iw,
    stride_yb,
    stride_yd,
    stride_yl,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    pid_l = tl.program_id(0)
    pid_d = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_l = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    x_ptr += pid_b.to(tl.int64) * stride_xb
    init_ptr += pid_b.to(tl.int64) * stride_ib
    acc = _pre_activation(
        x_ptr,
        init_ptr,
        w_ptr,
        b_ptr,
        offs_l,
        offs_d,
        mask_d,
        L,
        stride_xd,
        stride_xl,
        stride_id,
        stride_iw,
        stride_wd,
        stride_ww,
        W,
        HAS_BIAS,
        HAS_INIT,
        BLOCK_D,
        BLOCK_L,
    )
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


@triton.jit
def _conv_bwd_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    init_ptr,
    dy_ptr,
    dx_ptr,
    dinit_ptr,
    dw_part_ptr,
    db_part_ptr,
    D,
    L,
    NUM_L_BLOCKS,
    stride_xb,
    stride_xd,
    stride_xl,
    stride_wd,
    stride_ww,
    stride_ib,
    stride_id,
    stride_iw,
    stride_dyb,
    stride_dyd,
    stride_dyl,
    stride_dxb,
    stride_dxd,
    stride_dxl,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
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
            pre = _pre_activation(
                x_ptr,
                init_ptr,
                w_ptr,
                b_ptr,
                t,
                offs_d,
                mask_d,
                L,
                stride_xd,
                stride_xl,
                stride_id,
                stride_iw,
                stride_wd,
                stride_ww,
                W,
                HAS_BIAS,
                HAS_INIT,
                BLOCK_D,
                BLOCK_L,
            )
            sig = tl.sigmoid(pre)
            g = g * sig * (1.0 + pre * (1.0 - sig))
        wv = tl.load(w_ptr + offs_d * stride_wd + (W - 1 - k) * stride_ww, mask=mask_d, other=0.0)
        dx += wv.to(tl.float32)[:, None] * g
        if k == 0:
            # This tile's g[s] for s in [0, L) partitions the positions exactly once across
            # tiles: the partial sums of dweight and dbias come from here.
            part = pid_b * NUM_L_BLOCKS + pid_l
            for w in range(W):
                xv = _load_padded(
                    x_ptr,
                    init_ptr,
                    offs_s - (W - 1) + w,
                    offs_d,
                    mask_d,
                    L,
                    stride_xd,
                    stride_xl,
                    stride_id,
                    stride_iw,
                    W,
                    HAS_INIT,
                )
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


def _blocks(x: torch.Tensor, backward: bool) -> tuple[int, int]:
    """Tile shape: long along whichever of D and L is contiguous in memory.

    Sized from sm_90 cross-compiles (python -m kernels.compile_check): with the tap loops
    rolled, these tiles use 100-170 registers per thread at 4 warps and spill nothing, for
    every width.
    """
    D, L = x.shape[1], x.shape[2]
    if x.stride(1) == 1 and x.stride(2) != 1:  # (B, L, D) memory viewed as (B, D, L)
        block_d, block_l = 32, 32
    elif backward:
        block_d, block_l = 8, 128
    else:
        block_d, block_l = 8, 256
    return min(block_d, triton.next_power_of_2(D)), min(block_l, triton.next_power_of_2(L))


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """x (B, D, L), weight (D, W) -> y (B, D, L), same dtype and memory layout as x."""
    B, D, L = x.shape
    W = weight.shape[1]
    y = torch.empty_like(x)
    block_d, block_l = _blocks(x, backward=False)
    grid = (triton.cdiv(L, block_l), triton.cdiv(D, block_d), B)
    init = initial_states if initial_states is not None else x
    _conv_fwd_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        init,
        y,
        D,
        L,
        *x.stride(),
        *weight.stride(),
        *init.stride()[:3] if initial_states is not None else (0, 0, 0),
        *y.stride(),
        W=W,
        HAS_BIAS=bias is not None,
        HAS_INIT=initial_states is not None,
        SILU=silu,
        BLOCK_D=block_d,
        BLOCK_L=block_l,
        num_warps=4,
    )
    return y


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    silu: bool,
) -> list[torch.Tensor | None]:
    """Gradients (dx, dweight, dbias, dinitial_states); None for absent inputs."""
    B, D, L = x.shape
    W = weight.shape[1]
    block_d, block_l = _blocks(x, backward=True)
    num_l_blocks = triton.cdiv(L + W - 1, block_l)
    dx = torch.empty_like(x)
    dinit = None
    if initial_states is not None:
        dinit = torch.empty(B, D, W - 1, dtype=initial_states.dtype, device=x.device)
    dw_part = torch.empty(B * num_l_blocks, D, W, dtype=torch.float32, device=x.device)
    db_part = torch.empty(B * num_l_blocks, D, dtype=torch.float32, device=x.device)
    init = initial_states if initial_states is not None else x
    grid = (num_l_blocks, triton.cdiv(D, block_d), B)
    _conv_bwd_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        init,
        dy,
        dx,
        dinit if dinit is not None else dx,
        dw_part,
        db_part,
        D,
        L,
        num_l_blocks,
        *x.stride(),
        *weight.stride(),
        *init.stride()[:3] if initial_states is not None else (0, 0, 0),
        *dy.stride(),
        *dx.stride(),
        W=W,
        HAS_BIAS=bias is not None,
        HAS_INIT=initial_states is not None,
        SILU=silu,
        BLOCK_D=block_d,
        BLOCK_L=block_l,
        num_warps=4,
    )
    dweight = dw_part.sum(0).to(weight.dtype)
    dbias = None if bias is None else db_part.sum(0).to(bias.dtype)
    return [dx, dweight, dbias, dinit]


def hopper_specialisations() -> list:
    """The launch configurations to compile-check for sm_90 (see kernels.compile_check): both
    kernels, every flag, narrow and wide windows, both tile shapes, all three dtypes."""
    from kernels.compile_check import Specialisation

    specs = []
    tiles = {  # (kernel, layout) -> tile, as _blocks picks them
        (_conv_fwd_kernel, "length-major"): (8, 256),
        (_conv_bwd_kernel, "length-major"): (8, 128),
        (_conv_fwd_kernel, "channel-major"): (32, 32),
        (_conv_bwd_kernel, "channel-major"): (32, 32),
    }
    for dtype, width, layout, flags in (
        (torch.float32, 4, "length-major", (True, True, True)),
        (torch.float16, 1, "channel-major", (False, False, False)),
        (torch.bfloat16, 8, "length-major", (True, False, True)),
        (torch.bfloat16, 4, "channel-major", (False, True, False)),
    ):
        has_bias, has_init, silu = flags
        for kernel in (_conv_fwd_kernel, _conv_bwd_kernel):
            block_d, block_l = tiles[(kernel, layout)]
            constants = dict(
                W=width,
                HAS_BIAS=has_bias,
                HAS_INIT=has_init,
                SILU=silu,
                BLOCK_D=block_d,
                BLOCK_L=block_l,
            )
            specs.append(
                Specialisation(
                    kernel,
                    constants,
                    dtype,
                    warps=4,
                    float32_pointers=frozenset({"dw_part_ptr", "db_part_ptr"}),
                )
            )
    return specs
