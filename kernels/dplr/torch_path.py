"""The PyTorch path of the DPLR delta rule (CPU fast path): the chunked WY form in batched
matmuls, with an autograd backward through it.

Within a chunk of C steps from state S, with per-key-channel log decays g_i (K,), the segment
sums D[i, j] = g_{j+1} + ... + g_i (K,) give Gamma[i, j] = exp(D[i, j]) (j <= i) and
Gamma'[i, j] = exp(D[i - 1, j]) (j < i, what a_i sees of step j: a reads the memory before its
own step's decay). With e_i = exp(g_1 + ... + g_i), e'_i = e_{i-1} and w_j = exp(D[C, j]):

    A_qk[i, j] = sum_c q_ic Gamma[i, j]_c k_jc     A_qb: the same with b_j   (j <= i)
    A_ak[i, j] = sum_c a_ic Gamma'[i, j]_c k_jc    A_ab: the same with b_j   (j < i)
    U = (I - A_ab)^{-1} (A_ak V + diag(e') A S)     the chunk's u_t = S_{t-1}^T a_t rows
    O = diag(e) Q S + A_qk V + A_qb U
    S' = diag(e_C) S + (K * w)^T V + (B * w)^T U

so only U and S' are left to the sequential loop over chunks. The decays are exp of segment
sums, summed directly (a masked cumulative sum over each (C, C, K) block), never differences of
cumulative sums (a step with gk ~ -1e4 beside slow ones would cost the slow ones their float32
digits), and with gk <= 0 no exp of a positive number is taken. Every (i, j, c) decay is formed
on its own, so chunks stay short (`CHUNK_SIZE`): that is C * K exps per step. The sequence is
zero-padded to a multiple of C (k = v = a = b = 0, gk = 0 leave the state alone).

The backward recomputes this forward and takes its vector-Jacobian product (torch.func.vjp;
only the inputs are kept): the chunked form records some 30 operations per chunk, not per
step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mecheval_kernels._op import compute_dtype
from mecheval_kernels.dplr.op import DplrArgs

# Steps per chunk, the largest first whose decays all allow the factored form (SAFE_DECAY);
# sequences shorter than a chunk are one chunk of their own length. With none, the exact form
# runs on the last (it forms C x C x K decays: C * K exps per step). At the study's shape
# (B32 T37 H1 K=V=64) one chunk of 37 takes 2.6 ms forward, three of 16 7 ms (one thread).
CHUNK_SIZES = (64, 32, 16)
# The largest total log decay (per channel) of a chunk for which Gamma[i, j] is formed as
# exp(G_i) exp(-G_j) (two matmul operands) instead of exactly: exp(30) is far from float32's
# overflow, and the rounding of G (|G| * 6e-8) costs at most ~2e-6 relative per factor.
SAFE_DECAY = 30.0
TENSORS = ("q", "k", "v", "a", "b", "gk", "initial_state")


def _chunking(g: torch.Tensor) -> tuple[int, int, bool]:
    """(the chunk length, the number of chunks, whether the factored form holds) for the log
    decays g (B, T, H, K): the first of CHUNK_SIZES (capped at T) whose every chunk's total
    log decay is above -SAFE_DECAY in every channel (one read of a reduction per candidate, a
    sync on a GPU), else the last one, exact."""
    T = g.shape[1]
    for chunk in dict.fromkeys(min(c, T) for c in CHUNK_SIZES):
        n = -(-T // chunk)
        totals = F.pad(g, (0, 0, 0, 0, 0, n * chunk - T)).unflatten(1, (n, chunk)).sum(2)
        if bool((totals > -SAFE_DECAY).all()):
            return chunk, n, True
    return chunk, n, False


def _to_chunks(x: torch.Tensor, chunk: int, n: int) -> torch.Tensor:
    """(B, T, H, D) -> (n, B, H, chunk, D), zero-padded along T, contiguous (so that the
    batched matmuls read dense blocks)."""
    B, T, H, D = x.shape
    if n * chunk > T:
        x = F.pad(x, (0, 0, 0, 0, 0, n * chunk - T))
    return x.reshape(B, n, chunk, H, D).permute(1, 0, 3, 2, 4).contiguous()


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """(n, B, H, chunk, D) -> (B, T, H, D)."""
    n, B, H, C, D = x.shape
    return x.permute(1, 0, 3, 2, 4).reshape(B, n * C, H, D)[:, :T]


def empty_saved(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Nothing is kept for the backward (it recomputes): an empty placeholder."""
    return q.new_empty(0, dtype=compute_dtype(q))


class Decays(NamedTuple):
    """A chunk's decays from its log decays g (n, B, H, C, K) (see the module docstring).
    `gamma` (n, B, H, C, C, K) is formed only by the exact form (`factored` False); the
    factored form keeps exp(-G) instead (`inverse`, (n, B, H, C, K))."""

    e: torch.Tensor  # exp(G_i)
    e_prev: torch.Tensor  # exp(G_{i-1})
    w: torch.Tensor  # exp(G_C - G_j)
    last: torch.Tensor  # (n, B, H, 1, K) exp(G_C)
    gamma: torch.Tensor | None
    gamma_prev: torch.Tensor | None
    inverse: torch.Tensor | None

    def row(self, j: torch.Tensor, c: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Gamma[j, i] of chunks c, rows `rows` (index tensors of one shape S): (*S, H, C, K),
        zero for i > j."""
        if self.gamma is not None:
            return self.gamma[c, rows, :, j]
        steps = torch.arange(self.e.shape[3], device=j.device)
        written = (steps <= j[..., None])[..., None, :, None]  # (*S, 1, C, 1)
        return self.e[c, rows, :, j][..., None, :] * self.inverse[c, rows] * written


def _exact_decays(g: torch.Tensor) -> Decays:
    """Every Gamma[i, j]_c as exp of its own segment sum g_{j+1} + ... + g_i, summed directly
    (one add per step: a cumulative sum over a middle axis is several times slower on CPU)."""
    C = g.shape[-2]
    ones = torch.ones(C, C, dtype=torch.bool, device=g.device)
    later = ones.tril(-1)[..., None]  # [l, j]: l > j
    terms = g.unsqueeze(-2) * later  # [l, j] = g_l for l > j
    seg = [terms[..., 0, :, :]]
    for i in range(1, C):
        seg.append(seg[-1] + terms[..., i, :, :])
    seg = torch.stack(seg, dim=-3)  # seg[i, j] = g_{j+1} + ... + g_i
    gamma = seg.exp() * ones.tril()[..., None]
    gamma_prev = F.pad(seg[..., :-1, :, :], (0, 0, 0, 0, 1, 0)).exp() * later
    G = g.cumsum(-2)
    e_prev = F.pad(G[..., :-1, :], (0, 0, 1, 0)).exp()
    w = seg[..., -1, :, :].exp()
    return Decays(G.exp(), e_prev, w, G[..., -1:, :].exp(), gamma, gamma_prev, None)


def _factored_decays(g: torch.Tensor) -> Decays:
    """Gamma[i, j] = exp(G_i) exp(-G_j): valid while exp(-G) stays far from overflow and its
    rounding small (`SAFE_DECAY`)."""
    G = g.cumsum(-2)
    inverse = (-G).exp()
    last = G[..., -1:, :].exp()
    e_prev = F.pad(G[..., :-1, :], (0, 0, 1, 0)).exp()
    return Decays(G.exp(), e_prev, last * inverse, last, None, None, inverse)


def _pairs(q, k, a, b, d: Decays) -> tuple[torch.Tensor, ...]:
    """A_qk, A_qb (j <= i) and A_ak, A_ab (j < i), (n, B, H, C, C)."""
    if d.gamma is None:
        qe, ae = q * d.e, a * d.e_prev
        ki, bi = (k * d.inverse).transpose(-1, -2), (b * d.inverse).transpose(-1, -2)
        return (qe @ ki).tril(), (qe @ bi).tril(), (ae @ ki).tril(-1), (ae @ bi).tril(-1)
    pair = lambda x, m, y: ((x.unsqueeze(-2) * m) * y.unsqueeze(-3)).sum(-1)  # noqa: E731
    return (
        pair(q, d.gamma, k),
        pair(q, d.gamma, b),
        pair(a, d.gamma_prev, k),
        pair(a, d.gamma_prev, b),
    )


class Pass(NamedTuple):
    """The chunked forward pass, (n, B, H, C, .) tensors in the compute dtype."""

    q: torch.Tensor  # pre-scaled
    k: torch.Tensor
    v: torch.Tensor
    b: torch.Tensor
    decays: Decays
    qk: torch.Tensor  # A_qk (n, B, H, C, C)
    qb: torch.Tensor  # A_qb
    u: torch.Tensor  # U (n, B, H, C, V)
    h: torch.Tensor | None  # the chunks' start states (n, B, H, K, V); None: all zero
    state: torch.Tensor | None  # after the last chunk (None: not asked for)


def run(args: DplrArgs, final: bool) -> Pass:
    """The chunked recurrence, differentiable; the state after the last chunk only if
    `final`."""
    compute = compute_dtype(args.q)
    chunk, n, factored = _chunking(args.gk.detach().to(compute))
    cut = lambda x: _to_chunks(x.to(compute), chunk, n)  # noqa: E731
    q, k, v, a, b, g = (cut(getattr(args, f)) for f in ("q", "k", "v", "a", "b", "gk"))
    q = q * args.scale
    d = _factored_decays(g) if factored else _exact_decays(g)
    qk, qb, ak, ab = _pairs(q, k, a, b, d)
    eye = torch.eye(chunk, dtype=compute, device=q.device)
    inverse = torch.linalg.solve_triangular(eye - ab, eye, upper=False, unitriangular=True)
    u0, wa = inverse @ (ak @ v), inverse @ (a * d.e_prev)
    kw, bw = (k * d.w).transpose(-1, -2), (b * d.w).transpose(-1, -2)
    state = None if args.initial_state is None else args.initial_state.to(compute)
    starts, us = [], []
    for c in range(n):
        starts.append(state)
        u = u0[c] if state is None else u0[c] + wa[c] @ state
        us.append(u)
        if c + 1 < n or final:
            write = kw[c] @ v[c] + bw[c] @ u
            state = write if state is None else d.last[c].transpose(-1, -2) * state + write
    h = None
    if any(s is not None for s in starts):
        h = torch.stack([torch.zeros_like(starts[-1]) if s is None else s for s in starts])
    return Pass(q, k, v, b, d, qk, qb, torch.stack(us), h, state if final else None)


def _output(p: Pass) -> torch.Tensor:
    """O (n, B, H, C, V)."""
    o = p.qk @ p.v + p.qb @ p.u
    return o if p.h is None else o + (p.q * p.decays.e) @ p.h


def _final(args: DplrArgs, p: Pass) -> torch.Tensor | None:
    return p.state if args.output_final_state else None


def forward(args: DplrArgs) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """o (B, T, H, V) in q's dtype, the final state (B, H, K, V) in the compute dtype or None,
    and the (empty) saved buffer."""
    o, final = forward_inference(args)
    return o, final, empty_saved(args.q, args.v)


def forward_inference(args: DplrArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, the final state or None)."""
    p = run(args, args.output_final_state)
    o = _from_chunks(_output(p), args.q.shape[1]).to(args.q.dtype).contiguous()
    return o, _final(args, p)


def backward(args: DplrArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients of q, k, v, a, b, gk, initial_state (None for an absent initial state): the
    vector-Jacobian product of the recomputed chunked forward (torch.func.vjp, so that it also
    runs inside torch.vmap's backward)."""
    do, dfinal = grads[0], grads[1] if args.output_final_state else None
    final = dfinal is not None and dfinal.numel() > 0
    present = [f for f in TENSORS if getattr(args, f) is not None]

    def outputs(*tensors):
        p = run(args._replace(**dict(zip(present, tensors, strict=True))), final)
        o = _from_chunks(_output(p), args.q.shape[1])
        return (o, p.state) if final else (o,)

    with torch.enable_grad():
        primal, vjp = torch.func.vjp(outputs, *(getattr(args, f) for f in present))
        cotangents = (do.to(primal[0].dtype),) + ((dfinal.to(primal[1].dtype),) if final else ())
        found = vjp(cotangents)
    by_name = dict(zip(present, found, strict=True))
    return [by_name.get(f) for f in TENSORS]


def forward_states_at(args: DplrArgs, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(o, the final state or None, the states after steps at[b, :] of each row b
    (B, P, H, K, V)), without gradients: inside a chunk the state after step j is
    diag(e_j) S + (K * Gamma[j])^T V + (B * Gamma[j])^T U, from the chunk's start state S."""
    p = run(args, args.output_final_state)
    o = _from_chunks(_output(p), args.q.shape[1]).to(args.q.dtype).contiguous()
    chunk = p.q.shape[3]
    rows = torch.arange(at.shape[0], device=at.device)[:, None]
    c, j = at // chunk, at % chunk  # (B, P)
    weights = p.decays.row(j, c, rows)  # (B, P, H, C, K): Gamma[j, i], zero for i > j
    states = (p.k[c, rows] * weights).transpose(-1, -2) @ p.v[c, rows]
    states = states + (p.b[c, rows] * weights).transpose(-1, -2) @ p.u[c, rows]
    if p.h is not None:
        states = states + p.decays.e[c, rows, :, j][..., None] * p.h[c, rows]
    return o, _final(args, p), states


def forward_out_at(args: DplrArgs, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(o (B, 1, H, V) at step at[b] of each row b alone, the final state or None), without
    gradients: row j of O = diag(e) Q S + A_qk V + A_qb U."""
    p = run(args, args.output_final_state)
    chunk = p.q.shape[3]
    rows = torch.arange(at.shape[0], device=at.device)
    c, j = at // chunk, at % chunk
    pick = lambda x: x[c, rows]  # noqa: E731
    row_j = lambda x: pick(x)[rows, :, j][:, :, None]  # (B, H, 1, .)  # noqa: E731
    o = row_j(p.qk) @ pick(p.v) + row_j(p.qb) @ pick(p.u)
    if p.h is not None:
        o = o + (row_j(p.q) * row_j(p.decays.e)) @ pick(p.h)
    return o.transpose(1, 2).to(args.q.dtype), _final(args, p)
