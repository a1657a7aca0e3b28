"""`causal_conv1d_fn`: the public short-convolution op, its custom-op registration and autograd.

The op is registered with torch.library so that `torch.compile(fullgraph=True)` treats it as one
opaque node with a registered backward; which implementation runs is decided per call by
`kernels.backend` and passed to the custom op as a string.
"""

from __future__ import annotations

import torch

from kernels.backend import resolve_backend
from kernels.short_conv import torch_path
from kernels.validation import (
    allowed_dtypes,
    check_choice,
    check_range,
    check_same_device,
    check_tensor,
)

OP = "causal_conv1d_fn"
ACTIVATIONS = (None, "silu", "swish")
MAX_WIDTH = 8


def _impl(backend: str):
    if backend == "triton":
        from kernels.short_conv import triton_kernels

        return triton_kernels
    return torch_path


@torch.library.custom_op("mecheval::causal_conv1d_fwd", mutates_args=())
def _conv_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    silu: bool,
    backend: str,
) -> torch.Tensor:
    return _impl(backend).forward(x, weight, bias, initial_states, silu)


@_conv_fwd.register_fake
def _(x, weight, bias, initial_states, silu, backend):
    return torch.empty_like(x)


@torch.library.custom_op("mecheval::causal_conv1d_bwd", mutates_args=())
def _conv_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    silu: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dweight, dbias, dinit = _impl(backend).backward(dy, x, weight, bias, initial_states, silu)
    # Custom ops return tensors only: absent inputs get distinct empty placeholders (outputs
    # may not alias), which the autograd glue drops.
    return (
        dx,
        dweight,
        x.new_empty(0) if dbias is None else dbias,
        x.new_empty(0) if dinit is None else dinit,
    )


@_conv_bwd.register_fake
def _(dy, x, weight, bias, initial_states, silu, backend):
    return (
        torch.empty_like(x),
        torch.empty_like(weight),
        x.new_empty(0) if bias is None else torch.empty_like(bias),
        x.new_empty(0) if initial_states is None else torch.empty_like(initial_states),
    )


def _setup_context(ctx, inputs, output):
    x, weight, bias, initial_states, silu, backend = inputs
    ctx.save_for_backward(x, weight, bias, initial_states)
    ctx.silu, ctx.backend = silu, backend


def _backward(ctx, dy):
    x, weight, bias, initial_states = ctx.saved_tensors
    dx, dweight, dbias, dinit = _conv_bwd(
        dy, x, weight, bias, initial_states, ctx.silu, ctx.backend
    )
    return (
        dx,
        dweight,
        None if bias is None else dbias,
        None if initial_states is None else dinit,
        None,
        None,
    )


_conv_fwd.register_autograd(_backward, setup_context=_setup_context)


def _validate(x, weight, bias, activation, initial_states, backend: str) -> None:
    dtypes = allowed_dtypes(backend)
    sizes: dict[str, int] = {}
    check_tensor(OP, "x", x, "B D L", sizes, dtypes)
    check_tensor(OP, "weight", weight, "D W", sizes, dtypes)
    check_range(OP, "weight width W", sizes["W"], 1, MAX_WIDTH)
    if sizes["L"] < 1:
        raise ValueError(f"{OP}: x must have at least one position (L >= 1), got L = 0")
    if bias is not None:
        check_tensor(OP, "bias", bias, "D", sizes, dtypes)
    if initial_states is not None:
        sizes["W-1"] = sizes["W"] - 1
        check_tensor(OP, "initial_states", initial_states, "B D W-1", sizes, dtypes)
    check_choice(OP, "activation", activation, ACTIVATIONS)


def _final_states(x: torch.Tensor, initial_states: torch.Tensor | None, width: int) -> torch.Tensor:
    """The last W - 1 inputs, reaching into initial_states when L < W - 1; differentiable."""
    B, D, L = x.shape
    keep = width - 1
    tail = x[:, :, max(L - keep, 0) :]
    if tail.shape[-1] < keep:
        before = initial_states if initial_states is not None else x.new_zeros(B, D, keep)
        tail = torch.cat([before.to(x.dtype), tail], dim=-1)[:, :, -keep:]
    return tail.contiguous()


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Short causal depthwise convolution, drop-in for `causal_conv1d.causal_conv1d_fn`.

    Args:
        x: (B, D, L) float32/float16/bfloat16; any strides (a (B, L, D) tensor transposed to
            (B, D, L) is read in place).
        weight: (D, W), width W from 1 to 8.
        bias: optional (D,).
        activation: None, "silu" or "swish".
        initial_states: optional (B, D, W-1), the W - 1 inputs before x[..., 0].
        return_final_states: also return the last W - 1 inputs, (B, D, W-1), to continue from.
        backend: "auto", "triton" or "torch"; None uses the process default (kernels.backend).

    Returns:
        y (B, D, L) in x's dtype and memory layout, or (y, final_states).
    """
    check_tensor(OP, "x", x, "B D L", {})
    tensors = dict(x=x, weight=weight, bias=bias, initial_states=initial_states)
    device = check_same_device(
        OP, **{k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    )
    chosen = resolve_backend(OP, backend, device)
    _validate(x, weight, bias, activation, initial_states, chosen)
    y = _conv_fwd(x, weight, bias, initial_states, activation is not None, chosen)
    if not return_final_states:
        return y
    return y, _final_states(x, initial_states, weight.shape[1])
