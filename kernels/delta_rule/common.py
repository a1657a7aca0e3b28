"""What the delta-rule family's Triton kernels share: the chunk size, the products, the index
arithmetic of the (B, T, H, .) inputs and of the (B * H, K, V) state tiles, and the gate's
in-chunk decays (one per head, USE_G; one per key channel, USE_GK, KDA; Comba's recalls before
the decay, USE_P).

Notation per batch row and head (see reference.py): state S (K, V); a chunk is C consecutive
steps with rows Q, K (C, K), V (C, V), beta (C); Kb = diag(beta) K. Within a chunk the steps
unroll to the WY form

    A = (I + tril(Kb K^T, -1))^{-1}        (C, C), unit lower triangular
    U = A (diag(beta) V - Kb S)            the chunk's u_t rows
    O = scale * (Q S + tril(Q K^T) U)      (tril keeps the diagonal: o_t reads S_t)
    S' = S + K^T U

With the gate (the gated delta rule, the kernels' USE_G flag), from the chunk's log decays g (C,)
(zero on padded steps): e_i = exp(G_i) with G_i = g_1 + ... + g_i, e_C = exp(G_C), and the
segment sums D[i, j] = g_{j+1} + ... + g_i, which give Gamma[i, j] = exp(D[i, j]) for j <= i and
w_j = exp(D[C, j]) = exp(G_C - G_j); then

    A = (I + tril(Kb K^T, -1) * Gamma)^{-1}
    U = A (diag(beta) V - diag(e) Kb S)
    O = scale * (diag(e) Q S + (tril(Q K^T) * Gamma) U)
    S' = e_C S + (diag(w) K)^T U

The segment sums are summed directly (a masked cumulative sum per column), never formed as
G_i - G_j: with large decays (|G| ~ 1e4) that difference loses every digit float32 has, while
the sums of same-sign terms stay accurate; and no exp of a positive number is ever taken when
g <= 0. The kernels recompute the decays from g where they need them (a (C, C) cumulative sum).

With a decay per key channel (USE_GK) e, e_C and w are (C, K) and (K,) tiles and Gamma a
(C, C, K) one: the products with it are sums over K of elementwise products (`key_pairs`,
`key_mix`), in K blocks, over chunks of KEY_CHUNK = 16 steps. Comba (USE_P) recalls with its key
p before each step's decay: in L and R, Kb becomes Pb = diag(beta) P, Gamma becomes Gamma_r
(exp(G_{i-1} - G_j)) and e becomes e_r (exp(G_{i-1})) (`recall_decays`).

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
# KDA's chunks: its Gamma is a (C, C, K block) tile; at 16 steps one block of the inverse.
KEY_CHUNK = 16


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


@triton.jit
def state_program(ptr, H, K, V, PRESENT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """A state pass's program (V block, batch row x head): (b, h, bh64, offs_k, offs_v, mask_k,
    mask_v, state_offs, mask_kv) of `state_tile`, and the float32 tile of the (B * H, K, V)
    state at `ptr` it starts from (`load_state`: zeros when not PRESENT)."""
    bh = tl.program_id(1)
    offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv = state_tile(tl.program_id(0), K, V, BK, BV)
    bh64 = bh.to(tl.int64)
    state = load_state(ptr, bh64, K, V, state_offs, mask_kv, PRESENT, BK, BV)
    return bh // H, bh % H, bh64, offs_k, offs_v, mask_k, mask_v, state_offs, mask_kv, state


@triton.jit
def chunk_decays(g_ptr, row_base, mask_t, C: tl.constexpr):
    """The decays of the chunk whose (B, T, H) rows are row_base: (e (C,), e_C (scalar), w (C,),
    Gamma (C, C), zero above the diagonal), float32. The kernels form them before they load the
    chunk's rows: formed after, the sm_90 compile of the state kernels spills several times
    more at K = V = 256 in fp32 (mecheval_kernels.compile_check)."""
    g = tl.load(g_ptr + row_base, mask=mask_t, other=0.0).to(tl.float32)
    offs = tl.arange(0, C)
    rows = offs[:, None]
    cols = offs[None, :]
    seg = tl.cumsum(tl.where(rows > cols, g[:, None], 0.0), 0)  # D[i, j]
    w = tl.exp(tl.sum(tl.where(rows == C - 1, seg, 0.0), axis=0))
    gamma = tl.where(rows >= cols, tl.exp(seg), 0.0)
    return tl.exp(tl.cumsum(g, 0)), tl.exp(tl.sum(g, axis=0)), w, gamma


@triton.jit
def recall_decays(g_ptr, row_base, mask_t, H, C: tl.constexpr):
    """Comba's recalls read the memory before their step's decay: (e_r (C,), Gamma_r (C, C)) with
    e_r[i] = exp(G_{i-1}) and Gamma_r[i, j] = exp(g_{j+1} + ... + g_{i-1}) for j < i (zero
    elsewhere), from each row's previous one (row_base - H; zero before the chunk), summed
    directly."""
    offs = tl.arange(0, C)
    rows = offs[:, None]
    cols = offs[None, :]
    prev = tl.load(g_ptr + row_base - H, mask=mask_t & (offs > 0), other=0.0).to(tl.float32)
    seg = tl.cumsum(tl.where(rows - 1 > cols, prev[:, None], 0.0), 0)
    return tl.exp(tl.cumsum(prev, 0)), tl.where(rows > cols, tl.exp(seg), 0.0)


@triton.jit
def key_decays(g_ptr, row_base, t, mask_t, offs_k, mask_k, T, H, K, C: tl.constexpr):
    """A decay per key channel (KDA's g (B, T, H, K)), channels offs_k: (e (C, BK), e_C (BK,),
    w (C, BK)), float32; w_j = exp(g_{j+1} + ... + g_C) summed directly from the next rows (never
    as G_C - G_j)."""
    offs = tl.arange(0, C)
    g = load_rows(g_ptr, row_base, mask_t, offs_k, mask_k, K).to(tl.float32)
    later = mask_t & (offs < C - 1) & (t + 1 < T)  # the next row, inside the chunk
    after = load_rows(g_ptr, row_base + H, later, offs_k, mask_k, K).to(tl.float32)
    w = tl.exp(tl.cumsum(after, 0, reverse=True))
    return tl.exp(tl.cumsum(g, 0)), tl.exp(tl.sum(g, axis=0)), w


@triton.jit
def key_gamma(g_ptr, row_base, mask_t, offs_k, mask_k, K, C: tl.constexpr):
    """Gamma of a decay per key channel, (C, C, BK): exp(g_{j+1} + ... + g_i) channel by channel
    for j <= i, zero above the diagonal (each column's segment summed directly)."""
    offs = tl.arange(0, C)
    rows = offs[:, None, None]
    cols = offs[None, :, None]
    g = load_rows(g_ptr, row_base, mask_t, offs_k, mask_k, K).to(tl.float32)
    seg = tl.cumsum(tl.where(rows > cols, g[:, None, :], 0.0), 0)
    return tl.where(rows >= cols, tl.exp(seg), 0.0)


@triton.jit
def key_pairs(a, b, gamma):
    """sum_d a[i, d] b[j, d] gamma[i, j, d]: (C, C) from (C, BK) rows and a (C, C, BK) Gamma."""
    return tl.sum(a.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :] * gamma, axis=2)


@triton.jit
def key_mix(m, x, gamma):
    """sum_j m[i, j] gamma[i, j, d] x[j, d]: (C, BK)."""
    return tl.sum(m[:, :, None] * gamma * x.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def key_mix_t(m, x, gamma):
    """sum_i m[i, j] gamma[i, j, d] x[i, d]: (C, BK)."""
    return tl.sum(m[:, :, None] * gamma * x.to(tl.float32)[:, None, :], axis=0)


@triton.jit
def key_scores(q_ptr, k_ptr, g_ptr, row_base, mask_t, K, C: tl.constexpr, BKG: tl.constexpr):
    """P = sum_d q_id k_jd Gamma[i, j, d] of a decay per key channel, (C, C), in K blocks of
    BKG (Gamma is a (C, C, BKG) tile)."""
    qk = tl.zeros((C, C), dtype=tl.float32)
    for k0 in range(0, K, BKG):
        offs = k0 + tl.arange(0, BKG)
        mask = offs < K
        qb = load_rows(q_ptr, row_base, mask_t, offs, mask, K)
        kb = load_rows(k_ptr, row_base, mask_t, offs, mask, K)
        qk += key_pairs(qb, kb, key_gamma(g_ptr, row_base, mask_t, offs, mask, K, C))
    return qk
