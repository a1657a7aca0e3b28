"""The PyTorch path of Mamba-3's core scan (CPU fast path): the chunked SSD form in batched
matmuls, the R ranks of a step as R rows, with a vector-Jacobian-product backward.

The core (mecheval_kernels.mamba3.op: CoreArgs) is a scalar-decay linear recurrence with rank-R
writes, per batch row and head:  h_t = exp(a_t) h_{t-1} + s_t sum_r v_{t,r} k_{t,r}^T,
y_{t,r} = h_t q_{t,r}  (h (P, N)). Within a chunk of C steps from state h, with the segment sums
D[i, j] = a_{j+1} + ... + a_i, Gamma[i, j] = exp(D[i, j]) (j <= i), e_i = exp(a_1 + ... + a_i),
w_j = exp(D[C, j]) (while every chunk's decays are moderate, Gamma is formed from two
factors instead: `_decays`):

    Y = ((Q K^T) * (Gamma diag(s))_R) V + diag(e)_R Q h^T
    h' = e_C h + (diag(w s)_R V)^T K

where _R repeats each step's entry over its R rows (rows (i, r) of Q, K, V). Only h' is left to
the sequential loop over chunks. With strong decays (a chunk's total below -SAFE_DECAY) the
segment sums are summed directly (a masked cumulative sum of a (C, C) block per head), never
differences of cumulative sums, and with a <= 0 no exp of a positive number is taken; with
moderate ones Gamma is exp(A_i) exp(-A_j), two factors of at most exp(SAFE_DECAY). The
sequence is zero-padded to a multiple of C (a = s = 0 there).

The backward recomputes this forward and takes its vector-Jacobian product (torch.func.vjp;
only the inputs are kept).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mecheval_kernels._op import compute_dtype
from mecheval_kernels.mamba3.core import CoreArgs

# Rows per chunk (steps times ranks): one chunk up to this length (the study's 37 positions
# run in one), else chunks of this many rows (at least 16 steps); the in-chunk product is
# quadratic in the rows (MIMO rank 4 at 37 steps: 148 rows took longer than the per-step
# reference).
CHUNK_SIZE = 64
# The largest total log decay of a chunk for which Gamma[i, j] is formed as exp(A_i) exp(-A_j):
# exp(30) is far from float32's overflow, and the rounding of A (|A| * 6e-8) costs at most
# ~2e-6 relative per factor.
SAFE_DECAY = 30.0
TENSORS = ("q", "k", "v", "a", "s", "initial_state")


def _steps(x: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    """(B, L, R, H, D) -> (n, B, H, chunk * R, D), zero-padded along L (no copy for one chunk
    of a view of a head-major (B, H, L, R, D) tensor, as mecheval_kernels.mamba3.prepare
    makes them)."""
    B, L, R, H, D = x.shape
    if n * chunk > L:
        x = F.pad(x, (0, 0, 0, 0, 0, 0, 0, n * chunk - L))
    x = x.reshape(B, n, chunk, R, H, D).permute(1, 0, 4, 2, 3, 5)
    return x.reshape(n, B, H, chunk * R, D).contiguous()


def _scalars(x: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    """(B, L, H) -> (n, B, H, chunk), zero-padded along L."""
    B, L, H = x.shape
    if n * chunk > L:
        x = F.pad(x, (0, 0, 0, n * chunk - L))
    return x.reshape(B, n, chunk, H).permute(1, 0, 3, 2).contiguous()


def empty_saved(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Nothing is kept for the backward (it recomputes): an empty placeholder."""
    return q.new_empty(0, dtype=compute_dtype(q))


class Pass(NamedTuple):
    """The chunked forward pass; (n, B, H, C R, .) rows and (n, B, H, C, .) decays."""

    q: torch.Tensor | None
    k: torch.Tensor
    v: torch.Tensor
    s: torch.Tensor  # (n, B, H, C)
    gamma: torch.Tensor  # (n, B, H, C, C)
    e: torch.Tensor  # (n, B, H, C)
    y: torch.Tensor | None  # (n, B, H, C R, P); None: not formed
    h: torch.Tensor | None  # the chunks' start states (n, B, H, P, N); None: all zero
    state: torch.Tensor | None  # after the last chunk (None: not asked for)


def _decays(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Gamma (n, B, H, C, C), e (n, B, H, C), w (n, B, H, C), e_C (n, B, H) from a: factored,
    Gamma[i, j] = exp(A_i) exp(-A_j) (A the chunk's cumulative log decay), while every chunk's
    total is above -SAFE_DECAY (one read of a reduction: a sync on a GPU); else each entry the
    exp of its own segment sum (C x C exps per head: at the grid's size most of a call)."""
    C = a.shape[-1]
    A = a.cumsum(-1)
    ones = torch.ones(C, C, dtype=torch.bool, device=a.device)
    if bool((A[..., -1] > -SAFE_DECAY).all()):
        e, inverse = A.exp(), (-A).exp()
        gamma = e[..., :, None] * inverse[..., None, :] * ones.tril()
        return gamma, e, e[..., -1:] * inverse, e[..., -1]
    seg = (a[..., :, None] * ones.tril(-1)).cumsum(-2)  # [i, j] = a_{j+1} + ... + a_i
    gamma = seg.exp() * ones.tril()
    return gamma, A.exp(), seg[..., -1, :].exp(), a.sum(-1).exp()


def run(args: CoreArgs, final: bool, outputs: bool = True) -> Pass:
    """The chunked recurrence, differentiable; the state after the last chunk only if
    `final`; the outputs y only if `outputs` (else args.q is not read)."""
    compute = compute_dtype(args.k)
    B, L, R, H, N = args.k.shape
    chunk = min(max(16, CHUNK_SIZE // R), L)  # chunks of about CHUNK_SIZE rows
    n = -(-L // chunk)
    k, v = (_steps(getattr(args, f).to(compute), chunk, n) for f in ("k", "v"))
    a, s = (_scalars(getattr(args, f).to(compute), chunk, n) for f in ("a", "s"))
    gamma, e, w, last = _decays(a)
    ranks = lambda x: x if R == 1 else x.repeat_interleave(R, -1)  # noqa: E731
    # The writes of every chunk whose end state is needed (the last one's only if `final`).
    kept = n if final else n - 1
    writes = (v[:kept] * ranks(w[:kept] * s[:kept])[..., None]).transpose(-1, -2) @ k[:kept]
    state = None if args.initial_state is None else args.initial_state.to(compute)
    starts = []
    for c in range(n):
        starts.append(state)
        if c < kept:
            state = writes[c] if state is None else last[c][..., None, None] * state + writes[c]
    h = None
    if any(x is not None for x in starts):
        h = torch.stack([torch.zeros_like(starts[-1]) if x is None else x for x in starts])
    q = y = None
    if outputs:
        q = _steps(args.q.to(compute), chunk, n)
        weights = (gamma * s[..., None, :])[..., :, None, :, None]  # (.., C, 1, C, 1)
        scores = (q @ k.transpose(-1, -2)).unflatten(-1, (chunk, R)).unflatten(-3, (chunk, R))
        y = (scores * weights).flatten(-4, -3).flatten(-2) @ v
        if h is not None:
            y = y + ranks(e)[..., None] * (q @ h.transpose(-1, -2))
    return Pass(q, k, v, s, gamma, e, y, h, state if final else None)


def _unsteps(y: torch.Tensor, L: int, R: int) -> torch.Tensor:
    """(n, B, H, C R, P) -> (B, L, R, H, P)."""
    n, B, H, CR, P = y.shape
    y = y.reshape(n, B, H, CR // R, R, P).permute(1, 0, 3, 4, 2, 5)
    return y.reshape(B, n * (CR // R), R, H, P)[:, :L]


def forward_inference(args: CoreArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y (B, L, R, H, P) in the compute dtype, the final state (B, H, P, N) or None)."""
    p = run(args, args.output_final_state)
    return _unsteps(p.y, args.q.shape[1], args.q.shape[2]).contiguous(), p.state


def forward(args: CoreArgs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """y, the final state or None, and the (empty) saved buffer."""
    y, final = forward_inference(args)
    return y, final, empty_saved(args.q, args.v)


def backward(args: CoreArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients of q, k, v, a, s, initial_state (None for an absent initial state): the
    vector-Jacobian product of the recomputed chunked forward."""
    dy, dfinal = grads[0], grads[1] if args.output_final_state else None
    final = dfinal is not None and dfinal.numel() > 0
    present = [f for f in TENSORS if getattr(args, f) is not None]
    L, R = args.q.shape[1], args.q.shape[2]

    def outputs(*tensors):
        p = run(args._replace(**dict(zip(present, tensors, strict=True))), final)
        y = _unsteps(p.y, L, R)
        return (y, p.state) if final else (y,)

    with torch.enable_grad():
        primal, vjp = torch.func.vjp(outputs, *(getattr(args, f) for f in present))
        cotangents = (dy.to(primal[0].dtype),) + ((dfinal.to(primal[1].dtype),) if final else ())
        found = vjp(cotangents)
    by_name = dict(zip(present, found, strict=True))
    return [by_name.get(f) for f in TENSORS]


def forward_states_at(args: CoreArgs, at: torch.Tensor, outputs: bool = True) -> tuple:
    """(y or None (without `outputs`: args.q is not read), the final state or None, the states
    after steps at[b, :] of each row b (B, P', H, P, N)), without gradients: inside a chunk the
    state after step j is e_j h + (diag(Gamma[j] s)_R V)^T K, from the chunk's start state
    h."""
    p = run(args, args.output_final_state, outputs)
    n, B, H, CR, P = p.v.shape
    L, R = args.k.shape[1], args.k.shape[2]
    chunk = p.s.shape[-1]
    rows = torch.arange(B, device=at.device)[:, None]
    c, j = at // chunk, at % chunk  # (B, P')
    # Each position's weights over every step of the sequence (zero outside its chunk and
    # after it), so that V and K are read in place: no per-position copy of its chunk.
    weights = torch.zeros(B, at.shape[1], H, n, chunk, dtype=p.s.dtype, device=at.device)
    picks = torch.arange(at.shape[1], device=at.device)[None, :]
    weights[rows, picks, :, c] = p.gamma[c, rows, :, j] * p.s[c, rows]
    weights = weights.flatten(-2)
    weights = weights if R == 1 else weights.repeat_interleave(R, -1)  # (B, P', H, n C R)
    v = p.v.permute(1, 2, 4, 0, 3).reshape(B, 1, H, P, n * CR)  # V^T, steps last
    k = p.k.permute(1, 2, 0, 3, 4).reshape(B, 1, H, n * CR, -1)
    states = (v * weights[..., None, :]) @ k
    if p.h is not None:
        states = states + p.e[c, rows, :, j][..., None, None] * p.h[c, rows]
    y = None if p.y is None else _unsteps(p.y, L, R).contiguous()
    return y, p.state, states
