"""What the gated delta rule's Triton kernels share beyond the delta rule's helpers
(kernels/delta_rule/common.py: chunk size, products, index arithmetic): the in-chunk decays.

Notation per batch row and head (see torch_path.py): a chunk's cumulative log decays G (C,)
are stored by the inverse kernel, one float32 row of C per chunk (padded steps have g = 0, so
their G is the chunk's total); e = exp(G), w = exp(G_C - G) and Gamma[i, j] = exp(G_i - G_j)
for j <= i. Differences are masked before the exp, so no exp of a large positive number is
ever taken (with g <= 0 every factor is in [0, 1]).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_decays(gcum_ptr, bh64, c, NT, C: tl.constexpr):
    """Chunk c's G (C,) and its total G_C (a scalar), float32."""
    base = (bh64 * NT + c) * C
    return tl.load(gcum_ptr + base + tl.arange(0, C)), tl.load(gcum_ptr + base + C - 1)


@triton.jit
def decay_matrix(G, C: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Gamma (C, C): exp(G_i - G_j) at [i, j] for j <= i, else 0; or its transpose."""
    offs = tl.arange(0, C)
    if TRANSPOSED:
        diff = G[None, :] - G[:, None]  # [j, i] = G_i - G_j
        keep = offs[None, :] >= offs[:, None]
    else:
        diff = G[:, None] - G[None, :]
        keep = offs[:, None] >= offs[None, :]
    return tl.where(keep, tl.exp(tl.where(keep, diff, 0.0)), 0.0)
