"""What the delta rule's Triton kernels share: the chunk size, the products, and the index
arithmetic of the (B, T, H, .) inputs and of the (B * H, K, V) state tiles.

Notation per batch row and head (see reference.py): state S (K, V); a chunk is C consecutive
steps with rows Q, K (C, K), V (C, V), beta (C); Kb = diag(beta) K. Within a chunk the steps
unroll to the WY form

    A = (I + tril(Kb K^T, -1))^{-1}        (C, C), unit lower triangular
    U = A (diag(beta) V - Kb S)            the chunk's u_t rows
    O = scale * (Q S + tril(Q K^T) U)      (tril keeps the diagonal: o_t reads S_t)
    S' = S + K^T U

Precision: states and accumulators in float32; with float32 inputs every tl.dot runs in IEEE
float32, with float16/bfloat16 inputs tl.dot takes half-precision operands and accumulates in
float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Steps per chunk, for every head size and dtype. 64-row tl.dot tiles lower to sm_90's wgmma,
# which Triton miscompiled for these narrow V tiles; 32-row ones lower to mma.sync.
CHUNK = 32
SUB_BLOCK = 16  # diagonal blocks of the chunk inverse, inverted by substitution


@triton.jit
def dot(a, b, IEEE: tl.constexpr, DT: tl.constexpr):
    """a @ b accumulated in float32: IEEE float32 operands, or operands in DT (fp16/bf16)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DT), b.to(DT))


@triton.jit
def dot_f32(a, b, IEEE: tl.constexpr):
    """a @ b of float32 tiles: IEEE, or tf32 where the result is rounded to fp16/bf16 anyway."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def dot_t(a, b, IEEE: tl.constexpr, DT: tl.constexpr):
    """a^T @ b. In half precision it is computed as (b^T a)^T: the (K, V) state updates K^T U
    have K rows (up to 256) but only BV (<= 32) columns, and the transposed product keeps the
    tile that tl.dot sees at BV rows, so it lowers to mma.sync rather than sm_90's wgmma (see
    CHUNK). IEEE float32 products run on CUDA cores either way."""
    if IEEE:
        return dot(tl.trans(a), b, IEEE, DT)
    else:
        return tl.trans(dot(tl.trans(b), a, IEEE, DT))


@triton.jit
def chunk_rows(b, h, c, T, H, C: tl.constexpr):
    """Steps t (int64) of chunk c of batch row b and head h, their mask, and their rows in the
    (B, T, H, .) layout: (t, mask_t, row_base)."""
    t = (c * C + tl.arange(0, C)).to(tl.int64)
    mask_t = t < T
    row_base = (b.to(tl.int64) * T + t) * H + h
    return t, mask_t, row_base


@triton.jit
def load_rows(ptr, row_base, mask_t, offs, mask, WIDTH):
    """The (C, len(offs)) rows of a (B, T, H, WIDTH) tensor at columns `offs`."""
    return tl.load(
        ptr + row_base[:, None] * WIDTH + offs[None, :],
        mask=mask_t[:, None] & mask[None, :],
        other=0.0,
    )


@triton.jit
def state_tile(pid_v, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """The (BK, BV) state tile of V block pid_v: (offs_k, offs_v, mask_k, mask_v, offsets in a
    (K, V) state, their mask)."""
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    return (
        offs_k,
        offs_v,
        mask_k,
        mask_v,
        offs_k[:, None] * V + offs_v[None, :],
        (mask_k[:, None] & mask_v[None, :]),
    )


@triton.jit
def load_state(
    ptr, bh64, K, V, offs, mask, PRESENT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr
):
    """The float32 tile of a (B * H, K, V) state (an initial state or a gradient), or zeros
    when it is absent."""
    if PRESENT:
        state = tl.load(ptr + bh64 * K * V + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        state = tl.zeros((BK, BV), dtype=tl.float32)
    return state
