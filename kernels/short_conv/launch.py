"""Host side of the short convolution's Triton kernels: tiles, launches, the backward's
fixed-order reductions, and the launch configurations the Hopper compile check compiles."""

from __future__ import annotations

import torch
import triton

from mecheval_kernels._launch import Launch
from mecheval_kernels.short_conv.backward import conv_bwd_kernel
from mecheval_kernels.short_conv.forward import conv_fwd_kernel
from mecheval_kernels.short_conv.op import ConvArgs

KERNELS = {"forward": conv_fwd_kernel, "backward": conv_bwd_kernel}
# (BLOCK_D, BLOCK_L) per pass and memory layout, long along whichever of D and L is contiguous:
# with the tap loops rolled these use 100-170 registers at 4 warps on sm_90 and spill nothing.
TILES = {
    ("forward", "length-major"): (8, 256),
    ("backward", "length-major"): (8, 128),
    ("forward", "channel-major"): (32, 32),
    ("backward", "channel-major"): (32, 32),
}
WARPS = 4


def conv_launch(
    kernel_pass: str, layout: str, D: int, L: int, W: int, bias: bool, init: bool, silu: bool
) -> Launch:
    """The launch of one pass ("forward" or "backward") over x of layout "length-major" (L
    contiguous) or "channel-major" ((B, L, D) memory viewed as (B, D, L))."""
    block_d, block_l = TILES[(kernel_pass, layout)]
    constants = dict(
        W=W,
        HAS_BIAS=bias,
        HAS_INIT=init,
        SILU=silu,
        BLOCK_D=min(block_d, triton.next_power_of_2(D)),
        BLOCK_L=min(block_l, triton.next_power_of_2(L)),
    )
    return Launch(KERNELS[kernel_pass], constants, WARPS)


def _launch_for(a: ConvArgs, kernel_pass: str) -> Launch:
    B, D, L = a.x.shape
    channel_major = a.x.stride(1) == 1 and a.x.stride(2) != 1
    layout = "channel-major" if channel_major else "length-major"
    W = a.weight.shape[1]
    return conv_launch(
        kernel_pass, layout, D, L, W, a.bias is not None, a.initial_states is not None, a.silu
    )


def _inputs(a: ConvArgs) -> tuple:
    """The kernels' leading arguments: inputs (absent ones: any valid pointer, never read: the
    flags are compile-time; the bias is read contiguous), sizes, strides."""
    init = a.initial_states
    return (
        a.x,
        a.weight,
        a.weight if a.bias is None else a.bias.contiguous(),
        a.x if init is None else init,
        *a.x.shape[1:],
        *a.x.stride(),
        *a.weight.stride(),
        *((0, 0, 0) if init is None else init.stride()),
    )


def forward(a: ConvArgs) -> tuple[torch.Tensor, None]:
    """y (B, D, L), same dtype and memory layout as x (the backward keeps nothing)."""
    B, D, L = a.x.shape
    y = torch.empty_like(a.x)
    launch = _launch_for(a, "forward")
    grid = (
        triton.cdiv(L, launch.constants["BLOCK_L"]),
        triton.cdiv(D, launch.constants["BLOCK_D"]),
        B,
    )
    launch(grid, *_inputs(a), y, *y.stride())
    return y, None


def backward(a: ConvArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (dx, dweight, dbias, dinitial_states); None for absent inputs."""
    (dy,) = grads
    B, D, L = a.x.shape
    W = a.weight.shape[1]
    launch = _launch_for(a, "backward")
    num_l_blocks = triton.cdiv(L + W - 1, launch.constants["BLOCK_L"])
    dx = torch.empty_like(a.x)
    dinit = None
    if a.initial_states is not None:
        dinit = torch.empty(B, D, W - 1, dtype=a.initial_states.dtype, device=a.x.device)
    dw_part = torch.empty(B * num_l_blocks, D, W, dtype=torch.float32, device=a.x.device)
    db_part = torch.empty(B * num_l_blocks, D, dtype=torch.float32, device=a.x.device)
    grid = (num_l_blocks, triton.cdiv(D, launch.constants["BLOCK_D"]), B)
    dinit_arg = dx if dinit is None else dinit
    specific = (dy, dx, dinit_arg, dw_part, db_part, num_l_blocks, *dy.stride(), *dx.stride())
    launch(grid, *_inputs(a), *specific)
    dbias = None if a.bias is None else db_part.sum(0)
    return [dx, dw_part.sum(0), dbias, dinit]


def hopper_specialisations() -> list:
    """The launch configurations to compile-check for sm_90 (see mecheval_kernels.compile_check):
    both kernels, every flag, narrow and wide windows, both tile shapes, all three dtypes."""
    from mecheval_kernels.compile_check import Specialisation

    specs = []
    for dtype, width, layout, flags in (
        (torch.float32, 4, "length-major", (True, True, True)),
        (torch.float16, 1, "channel-major", (False, False, False)),
        (torch.bfloat16, 8, "length-major", (True, False, True)),
        (torch.bfloat16, 4, "channel-major", (False, True, False)),
    ):
        for kernel_pass in KERNELS:
            # Long enough for the full tile.
            launch = conv_launch(kernel_pass, layout, 1 << 16, 1 << 16, width, *flags)
            specs.append(
                Specialisation(
                    launch, dtype, float32_pointers=frozenset({"dw_part_ptr", "db_part_ptr"})
                )
            )
    return specs
