"""Output memory layouts that match the inputs they came from.

Custom ops declare their outputs' strides through their fake (meta) implementations, and
torch.compile checks the real outputs against them, so every backend must return the same
layout: that of `torch.empty_like(input)` (a (B, L, D) tensor viewed as (B, D, L) keeps its
layout; a sliced, non-dense one becomes contiguous).
"""

from __future__ import annotations

import torch


def match_layout(t: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None):
    """`t` in `dtype` (default: its own) with the strides of `torch.empty_like(like)`, copied
    only when either differs (the strides are worked out on the meta device: no allocation)."""
    dtype = t.dtype if dtype is None else dtype
    if t.dtype == dtype and t.stride() == torch.empty_like(like, device="meta").stride():
        return t
    return torch.empty_like(like, dtype=dtype).copy_(t)
