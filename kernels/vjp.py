"""Gradients of a PyTorch-path forward inside a custom op.

A custom op's implementation runs below autograd, so plain `torch.autograd.grad` sees no graph
there; `torch.func.vjp` builds its own. PyTorch paths whose backward is just the derivative of
their forward use this instead of hand-written formulas.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def vjp_of(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor | None],
    cotangents: torch.Tensor | tuple[torch.Tensor, ...],
) -> list[torch.Tensor | None]:
    """Vector-Jacobian product of `fn(*primals)` with `cotangents`.

    None primals are passed through to `fn` as None and get None gradients.
    """
    present = [i for i, p in enumerate(primals) if p is not None]

    def fn_of_present(*tensors: torch.Tensor):
        args = list(primals)
        for i, t in zip(present, tensors, strict=True):
            args[i] = t
        return fn(*args)

    _, pullback = torch.func.vjp(fn_of_present, *(primals[i] for i in present))
    grads = pullback(cotangents)
    out: list[torch.Tensor | None] = [None] * len(primals)
    for i, g in zip(present, grads, strict=True):
        out[i] = g
    return out
