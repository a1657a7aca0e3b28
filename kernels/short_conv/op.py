"""`causal_conv1d_fn`: the public short-convolution op (validation and the call of its custom
op; the scaffold is mecheval_kernels._op)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from mecheval_kernels._op import Op, compute_dtype, needs_grad
from mecheval_kernels.short_conv.reference import causal_conv1d_ref
from mecheval_kernels.stacking import fold_into, unfold_from
from mecheval_kernels.validation import (
    check_batch,
    check_choice,
    check_range,
    check_tensor,
    refuse_unsupported,
)

ACTIVATIONS = (None, "silu", "swish")
MAX_WIDTH = 8


class ConvArgs(NamedTuple):
    """The custom op's inputs; `save`: keep what the backward needs (the PyTorch path keeps the
    pre-activation; the Triton backward recomputes it)."""

    x: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    initial_states: torch.Tensor | None
    silu: bool
    save: bool


def _validate(dtypes, x, weight, bias, initial_states, activation) -> None:
    op = OP.public
    sizes: dict[str, int] = {}
    check_tensor(op, "x", x, "B D L", sizes, dtypes)
    check_batch(op, "x", sizes["B"])
    check_tensor(op, "weight", weight, "D W", sizes, dtypes)
    check_range(op, "weight width W", sizes["W"], 1, MAX_WIDTH)
    if sizes["L"] < 1:
        raise ValueError(f"{op}: x must have at least one position (L >= 1), got L = 0")
    check_tensor(op, "bias", bias, "D", sizes, dtypes, optional=True)
    sizes["W-1"] = sizes["W"] - 1
    check_tensor(op, "initial_states", initial_states, "B D W-1", sizes, dtypes, optional=True)
    check_choice(op, "activation", activation, ACTIVATIONS)


def _fake(a: ConvArgs, backend: str) -> tuple:
    keeps = backend == "torch" and a.silu and a.save  # the PyTorch path's pre-activation
    pre = torch.empty_like(a.x, dtype=compute_dtype(a.x)) if keeps else None  # x's layout
    return torch.empty_like(a.x), pre


def _fold(a: ConvArgs, dims: ConvArgs, m: int):
    """Stacked models (mecheval_kernels.stacking): the model axis folds into the channels."""
    folded = a._replace(
        x=fold_into(a.x, dims.x, m, 1),
        weight=fold_into(a.weight, dims.weight, m, 0),
        bias=fold_into(a.bias, dims.bias, m, 0),
        initial_states=fold_into(a.initial_states, dims.initial_states, m, 1),
    )
    folded = folded._replace(save=needs_grad(folded))  # unseen through the vmap
    return folded, lambda i, t: unfold_from(t, m, 1) if i == 0 else (t, None)


def _twice(a: ConvArgs) -> tuple[torch.Tensor]:
    """y recomputed by the reference (plain PyTorch), for second derivatives."""
    activation = "silu" if a.silu else None
    return (causal_conv1d_ref(a.x, a.weight, a.bias, activation, a.initial_states),)


OP = Op(
    __package__, "causal_conv1d_fn", ConvArgs, "B D L", _validate, _fake, 2, saved=1,
    fold=_fold, twice=_twice,
)  # fmt: skip


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
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Short causal depthwise convolution, drop-in for `causal_conv1d.causal_conv1d_fn`.

    Args:
        x: (B, D, L) float32/float16/bfloat16; any strides (a (B, L, D) tensor transposed to
            (B, D, L) is read in place).
        weight: (D, W), width W from 1 to 8 (ours: causal-conv1d stops at 4).
        bias: optional (D,).
        seq_idx: causal-conv1d's packed sequences; only None is supported (anything else is
            refused by name).
        initial_states: optional (B, D, W-1), the W - 1 inputs before x[..., 0].
        return_final_states: also return the last W - 1 inputs, (B, D, W-1), to continue from.
        final_states_out: optional (B, D, W-1) tensor the final states are written into (and
            returned as), with `return_final_states`.
        activation: None, "silu" or "swish".
        backend: "auto", "triton" or "torch"; None uses the process default
            (mecheval_kernels.backend).

    Returns:
        y (B, D, L) in x's dtype and memory layout, or (y, final_states).
    """
    refuse_unsupported(OP.public, seq_idx=(seq_idx, None))
    chosen = OP.check(
        backend, x=x, weight=weight, bias=bias, initial_states=initial_states, activation=activation
    )
    a = ConvArgs(x, weight, bias, initial_states, activation is not None, False)
    y, _ = OP(a._replace(save=needs_grad(a)), chosen)
    if not return_final_states:
        return y
    final = _final_states(x, initial_states, weight.shape[1])
    if final_states_out is not None:
        if not isinstance(final_states_out, torch.Tensor) or final_states_out.shape != final.shape:
            raise ValueError(
                f"{OP.public}: final_states_out must be a tensor of shape {tuple(final.shape)}, "
                f"got {tuple(getattr(final_states_out, 'shape', ()))}"
            )
        final = final_states_out.copy_(final)
    return y, final
