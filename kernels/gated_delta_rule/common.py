"""What the gated delta rule's Triton kernels share beyond the delta rule's helpers
(kernels/delta_rule/common.py: chunk size, products, index arithmetic): the in-chunk decays.

Notation per batch row and head (see torch_path.py): from a chunk's log decays g (C,) (zero on
padded steps), e_i = exp(G_i) with G_i = g_1 + ... + g_i, e_C = exp(G_C), and the segment
sums D[i, j] = g_{j+1} + ... + g_i, which give Gamma[i, j] = exp(D[i, j]) for j <= i and
w_j = exp(D[C, j]) = exp(G_C - G_j). The segment sums are summed directly (a masked cumulative
sum per column), never formed as G_i - G_j: with large decays (|G| ~ 1e4) that difference
loses every digit float32 has, while the sums of same-sign terms stay accurate; and no exp of
a positive number is ever taken when g <= 0.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_decays(g_ptr, row_base, mask_t, C: tl.constexpr):
    """The decays of the chunk whose (B, T, H) rows are row_base: (e (C,), e_C (scalar), w (C,),
    Gamma (C, C), zero above the diagonal), float32."""
    g = tl.load(g_ptr + row_base, mask=mask_t, other=0.0).to(tl.float32)
    offs = tl.arange(0, C)
    rows = offs[:, None]
    cols = offs[None, :]
    seg = tl.cumsum(tl.where(rows > cols, g[:, None], 0.0), 0)  # D[i, j]
    w = tl.exp(tl.sum(tl.where(rows == C - 1, seg, 0.0), axis=0))
    gamma = tl.where(rows >= cols, tl.exp(seg), 0.0)
    return tl.exp(tl.cumsum(g, 0)), tl.exp(tl.sum(g, axis=0)), w, gamma
