"""Mamba-3's scan around its core: what the drop-ins compute before and after the core
recurrence (mecheval_kernels.mamba3.op.CoreArgs), in PyTorch, differentiable by autograd.

The trapezoidal rule writes each step twice, (1 - lam_t) dt_t alpha_t v_{t-1} k_{t-1}^T at step
t and lam_t dt_t v_t k_t^T (reference.py). With c_t = (1 - lam_t) dt_t and h'_t = h_t +
c_{t+1} W_t (W_t = sum_r v_{t,r} k_{t,r}^T; c_L = 0 past the end), the state h' is the plain
linear recurrence

    h'_t = alpha_t h'_{t-1} + (lam_t dt_t + c_{t+1}) W_t ,   h'_{-1} = h_{-1} + c_0 W_{-1}

so the core runs it with a = adt and s = lam dt + c_next, and the outputs and states are
y_{t,r} = h'_t q_{t,r} - c_{t+1} W_t q_{t,r} and h_t = h'_t - c_{t+1} W_t (local corrections).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mecheval_kernels._op import compute_dtype
from mecheval_kernels.mamba3.core import CoreArgs

# Steps whose angles are summed in the compute dtype before a float64 sum across blocks.
ANGLE_BLOCK = 64


class Inputs(NamedTuple):
    """A drop-in call's validated arguments, SISO as rank 1: Q, K (B, L, R, G, N); V, Z
    (B, L, H, P); ADT, DT, Trap (B, H, L); Q_bias, K_bias (H, R, N); Angles (B, L, H, A);
    D (H,); mimo_v, mimo_z, mimo_out (H, R, P) (None: none); fused_norm: rmsnorm before the
    gate, with norm_weight (H, P) (None: no weight) and norm_eps; states (theta (B, H, A),
    h (B, H, P, N), k (B, R, H, N), v (B, R, H, P)) or None; pairs: the rotation's channel
    pairs ("pairwise", "halves"); out_dtype."""

    Q: torch.Tensor
    K: torch.Tensor
    V: torch.Tensor
    ADT: torch.Tensor
    DT: torch.Tensor
    Trap: torch.Tensor
    Q_bias: torch.Tensor
    K_bias: torch.Tensor
    Angles: torch.Tensor
    D: torch.Tensor | None
    Z: torch.Tensor | None
    mimo_v: torch.Tensor | None
    mimo_z: torch.Tensor | None
    mimo_out: torch.Tensor | None
    norm_weight: torch.Tensor | None
    fused_norm: bool
    norm_eps: float
    states: tuple | None
    pairs: str
    out_dtype: torch.dtype


class Prepared(NamedTuple):
    """The core's arguments and what the output and the states need beside them. q, k and v
    are (B, L, R, H, .) views of head-major (B, H, L, R, .) tensors (the core's chunks then
    need no copy); q is None when not formed (`prepare(queries=False)`: `queries_at` turns the
    few a caller needs)."""

    core: CoreArgs
    q: torch.Tensor | None  # (B, L, R, H, N) rotated
    k: torch.Tensor
    v: torch.Tensor  # (B, L, R, H, P)
    c_next: torch.Tensor  # (B, L, H): c_{t+1}
    theta: torch.Tensor  # (B, L, H, A): the cumulative angles


def turned(x: Inputs, t: torch.Tensor, bias: torch.Tensor, turn: torch.Tensor) -> torch.Tensor:
    """Q or K (B, L', R, G, N) plus its bias (H, R, N), turned by `turn` (`turning`):
    (B, L', R, H, N), a view of a head-major (B, H, L', R, N) tensor (each group's rows
    broadcast to its H / G heads by the bias's sum, one pass)."""
    dtype = compute_dtype(x.V)
    B, L, R, G, N = t.shape
    H = bias.shape[0]
    grouped = t.to(dtype).permute(0, 3, 1, 2, 4)[:, :, None]  # (B, G, 1, L', R, N)
    heads = grouped + bias.to(dtype).view(G, H // G, 1, R, N)
    return _rotated(heads.view(B, H, L, R, N), turn, x.pairs).permute(0, 2, 3, 1, 4)


def turning(theta: torch.Tensor) -> torch.Tensor:
    """The turn by theta (B, L', H, A), head-major (B, H, L', 1, A): exp(i theta) in eager mode
    (one complex product turns a pair: twice as fast on CPU as four real ones), the real
    (cos, sin) stacked last under torch.compile (inductor has no complex code)."""
    angles = theta.permute(0, 2, 1, 3)[:, :, :, None]
    if torch.compiler.is_compiling():
        return torch.stack([angles.cos(), angles.sin()], dim=-1)
    return torch.polar(torch.ones_like(angles), angles)


def _rotated(x: torch.Tensor, turn: torch.Tensor, pairs: str) -> torch.Tensor:
    """x (..., N) with its channel pairs turned (reference.rotate says which pairs)."""
    A, N = turn.shape[-1] if turn.is_complex() else turn.shape[-2], x.shape[-1]
    if pairs == "pairwise" and turn.is_complex():  # adjacent pairs: x's own memory as complex
        pairs_ = torch.view_as_complex(x[..., : 2 * A].unflatten(-1, (A, 2)))
        turned = torch.view_as_real(pairs_ * turn).flatten(-2)
        return torch.cat([turned, x[..., 2 * A :]], dim=-1) if 2 * A < N else turned
    if pairs == "pairwise":
        first, second, rest = x[..., 0 : 2 * A : 2], x[..., 1 : 2 * A : 2], x[..., 2 * A :]
    else:
        half = N // 2
        first, second = x[..., :A], x[..., half : half + A]
        rest = (x[..., A:half], x[..., half + A :])
    if turn.is_complex():
        c = torch.complex(first, second) * turn
        first, second = c.real, c.imag
    else:
        cos, sin = turn[..., 0], turn[..., 1]
        first, second = first * cos - second * sin, first * sin + second * cos
    if pairs == "pairwise":
        return torch.cat([torch.stack([first, second], dim=-1).flatten(-2), rest], dim=-1)
    return torch.cat([first, rest[0], second, rest[1]], dim=-1)


def prepare(x: Inputs, final: bool, queries: bool = True) -> Prepared:
    """The rotated q (unless not `queries`), k, the projected v, the core's a and s and start
    state (module docstring), in the compute dtype (float32; float64 for float64 inputs)."""
    dtype = compute_dtype(x.V)
    f = lambda t: t.to(dtype)  # noqa: E731
    dt, adt, lam = (f(t).transpose(1, 2) for t in (x.DT, x.ADT, x.Trap))  # (B, L, H)
    lam = torch.sigmoid(lam)
    angles = x.Angles
    if angles.shape[2] > 1 and angles.stride(2) == 0:  # one rate for every head (a layer's
        angles = angles[:, :, :1]  # angles expanded over heads): take the tanh once
    theta = _cumulative_angles(math.pi * torch.tanh(f(angles)) * dt[..., None], x.states)
    turn = turning(theta)
    q = turned(x, x.Q, x.Q_bias, turn) if queries else None
    k = turned(x, x.K, x.K_bias, turn)
    v = f(x.V).permute(0, 2, 1, 3)[:, :, :, None]  # (B, H, L, 1, P)
    if x.mimo_v is not None:
        v = v * f(x.mimo_v)[:, None]
    v = v.permute(0, 2, 3, 1, 4)
    c = (1 - lam) * dt
    c_next = F.pad(c[:, 1:], (0, 0, 0, 1))
    start = None
    if x.states is not None:
        _, h, k_prev, v_prev = (f(t) for t in x.states)
        start = h + c[:, 0, :, None, None] * torch.einsum("brhp,brhn->bhpn", v_prev, k_prev)
    core = CoreArgs(q, k, v, adt, lam * dt + c_next, start, final)
    return Prepared(core, q, k, v, c_next, theta)


def _cumulative_angles(steps: torch.Tensor, states: tuple | None) -> torch.Tensor:
    """theta = (theta_0 + the cumulative sum of steps (B, L, H, A) over L) mod 2 pi, in steps'
    dtype. Long sequences reach thousands of radians, of which float32 would keep ~1e-4: the
    sums run within blocks of ANGLE_BLOCK steps in steps' dtype, and across blocks in float64,
    taken mod 2 pi before they meet the in-block sums."""
    B, L, H, A = steps.shape
    n = -(-L // ANGLE_BLOCK)
    blocks = F.pad(steps, (0, 0, 0, 0, 0, n * ANGLE_BLOCK - L)).unflatten(1, (n, ANGLE_BLOCK))
    inner = blocks.cumsum(2)  # (B, n, block, H, A)
    start = F.pad(inner[:, :-1, -1].double().cumsum(1), (0, 0, 0, 0, 1, 0))  # (B, n, H, A)
    if states is not None:
        start = start + states[0].double()[:, None]
    start = torch.remainder(start, 2 * math.pi).to(steps.dtype)
    theta = (inner + start[:, :, None]).flatten(1, 2)[:, :L]
    return torch.remainder(theta, 2 * math.pi)


def queries_at(x: Inputs, p: Prepared, at: torch.Tensor) -> torch.Tensor:
    """The rotated queries at step at[b] of each row b alone: (B, 1, R, H, N)."""
    rows = torch.arange(at.shape[0], device=at.device)
    return turned(x, x.Q[rows, at][:, None], x.Q_bias, turning(p.theta[rows, at][:, None]))


def correction(q, k, v, c_next) -> torch.Tensor:
    """c_{t+1} W_t q_{t,r} (B, L, R, H, P): what y_{t,r} = h'_t q_{t,r} holds beyond h_t q."""
    if q.shape[2] == 1:  # SISO: one product per step and head
        return (c_next[:, :, None] * (q * k).sum(-1))[..., None] * v
    heads = lambda t: t.permute(0, 3, 1, 2, 4)  # (B, H, L', R, .)  # noqa: E731
    qk = heads(q) @ heads(k).transpose(-1, -2)  # (B, H, L', R, R): a step's own ranks
    corrected = (qk @ heads(v)).permute(0, 2, 3, 1, 4)  # (B, L', R, H, P)
    return c_next[:, :, None, :, None] * corrected


def state_correction(k, v, c_next) -> torch.Tensor:
    """c_{t+1} W_t (B, L, H, P, N): h'_t - h_t."""
    return c_next[..., None, None] * torch.einsum("blrhp,blrhn->blhpn", v, k)


def output(x: Inputs, y: torch.Tensor, v: torch.Tensor, Z: torch.Tensor | None) -> torch.Tensor:
    """out from y_{t,r} = h_t q_{t,r} (B, L', R, H, P) and the projected v at the same steps:
    the skip, the gate (or the fused norm and gate) and the MIMO contraction; Z (B, L', H, P)
    at those steps."""
    dtype = y.dtype
    if x.D is not None:
        y = y + x.D.to(dtype)[:, None] * v
    if Z is not None:
        z = Z.to(dtype)[:, :, None]
        gate = F.silu(z if x.mimo_z is None else z * x.mimo_z.to(dtype).transpose(0, 1))
        if x.fused_norm:
            y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + x.norm_eps)
            if x.norm_weight is not None:
                y = y * x.norm_weight.to(dtype)
        y = y * gate
    if x.mimo_out is not None:
        y = (y * x.mimo_out.to(dtype).transpose(0, 1)).sum(2)
    elif x.mimo_v is None:  # SISO: no rank axis
        y = y[:, :, 0]
    return y.to(x.out_dtype)


def final_states(x: Inputs, p: Prepared, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(theta mod 2 pi (B, H, A), h (B, H, P, N), the last k (B, R, H, N), the last projected
    v (B, R, H, P)), in the compute dtype."""
    return p.theta[:, -1], h, p.k[:, -1], p.v[:, -1]
