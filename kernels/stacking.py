"""Stacked models: the ops under `torch.vmap`, with the model axis folded into an axis the kernels
already have, so that M stacked models run in one kernel call.

`torch.vmap` over stacked weights (mecheval.train.stacked) hands an op tensors with an extra
leading axis of size M, the model. Each op folds it into an axis its kernels treat
independently: the channels of the short convolution and of the selective scan (whose B and C,
one per model, become M groups of channels), the heads of the delta rule. The folded call is the
op's ordinary call, on plain tensors, with its own autograd; the outputs are unfolded back to a
leading model axis. A tensor the vmap does not batch (shared by every model) is repeated.

An op's fold: fold(a, dims, m) -> (folded Args, unfold), where `dims` gives each field's batch
axis (None: not batched) and unfold(outputs) -> (outputs, their batch axes).
"""

from __future__ import annotations

import torch


def is_batched(t: object) -> bool:
    """Whether `t` is a tensor inside `torch.vmap` (a functorch batched tensor)."""
    return isinstance(t, torch.Tensor) and torch._C._functorch.is_batchedtensor(t)


def to_front(t: torch.Tensor | None, dim: int | None, m: int) -> torch.Tensor | None:
    """`t` with its model axis first (repeated M times when `dim` is None)."""
    if t is None:
        return None
    return t.expand(m, *t.shape) if dim is None else t.movedim(dim, 0)


def fold_into(t: torch.Tensor | None, dim: int | None, m: int, axis: int):
    """(M, ...) -> the model axis merged into `axis` (counted without it), model-major: index
    `k * size + i` is model k's index i. A channel axis that is innermost in memory stays
    innermost (the kernels read (B, L, D) tensors transposed to (B, D, L) in place)."""
    t = to_front(t, dim, m)
    if t is None:
        return None
    t = t.movedim(0, axis)  # (..., M, size, ...)
    if t.stride(axis + 1) == 1 and t.dim() > axis + 2:
        # Keep the channel axis innermost: fold in a channels-last copy, then view it back.
        order = [i for i in range(t.dim()) if i not in (axis, axis + 1)] + [axis, axis + 1]
        flat = t.permute(order).flatten(-2)
        back = list(range(axis)) + [flat.dim() - 1] + list(range(axis, flat.dim() - 1))
        return flat.permute(back)
    return t.flatten(axis, axis + 1)


def unfold_from(t: torch.Tensor, m: int, axis: int) -> tuple[torch.Tensor, int | None]:
    """The inverse of fold_into for an output: (tensor with the model axis first, 0); an empty
    placeholder (an absent output) stays as it is, unbatched."""
    if t.numel() == 0 and t.dim() == 1:
        return t, None
    return t.unflatten(axis, (m, t.shape[axis] // m)).movedim(axis, 0), 0
