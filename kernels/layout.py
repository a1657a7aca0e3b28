"""Output memory layouts that match the inputs they came from.

Custom ops declare their outputs' strides through their fake (meta) implementations, and
torch.compile checks the real outputs against them, so every backend must return the same
layout: that of `torch.empty_like(input)` (a (B, L, D) tensor viewed as (B, D, L) keeps its
layout; a sliced, non-dense one becomes contiguous).
"""

from __future__ import annotations

import torch


def match_layout(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` with the strides of `torch.empty_like(like)` (copied only when they differ)."""
    target = torch.empty_like(like, dtype=t.dtype)
    if t.stride() == target.stride():
        return t
    return target.copy_(t)
