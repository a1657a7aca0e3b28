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
from mecheval_kernels.mamba3.reference import rotate


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
    """The core's arguments and what the output and the states need beside them."""

    core: CoreArgs
    q: torch.Tensor  # (B, L, R, H, N) rotated
    k: torch.Tensor
    v: torch.Tensor  # (B, L, R, H, P)
    c_next: torch.Tensor  # (B, L, H): c_{t+1}
    theta: torch.Tensor  # (B, L, H, A): the cumulative angles


def prepare(x: Inputs, final: bool) -> Prepared:
    """The rotated q, k, the projected v, the core's a and s and start state (module
    docstring), in the compute dtype (float32; float64 for float64 inputs)."""
    dtype = compute_dtype(x.V)
    f = lambda t: t.to(dtype)  # noqa: E731
    B, L, R, G, N = x.Q.shape
    H = x.V.shape[2]
    dt, adt, lam = (f(t).transpose(1, 2) for t in (x.DT, x.ADT, x.Trap))  # (B, L, H)
    lam = torch.sigmoid(lam)
    # The angles accumulate in float64 and are taken mod 2 pi there: long sequences reach
    # thousands of radians, of which float32 would keep ~1e-4.
    steps = math.pi * torch.tanh(x.Angles.double()) * dt.double()[..., None]
    theta = steps.cumsum(1)
    if x.states is not None:
        theta = theta + x.states[0].double()[:, None]
    theta = f(torch.remainder(theta, 2 * math.pi))
    heads = lambda t: f(t).repeat_interleave(H // G, dim=-2)  # noqa: E731
    turn = lambda t, bias: rotate(heads(t) + f(bias).transpose(0, 1), theta[:, :, None], x.pairs)  # noqa: E731
    q, k = turn(x.Q, x.Q_bias), turn(x.K, x.K_bias)
    v = f(x.V)[:, :, None]
    if x.mimo_v is not None:
        v = v * f(x.mimo_v).transpose(0, 1)
    c = (1 - lam) * dt
    c_next = F.pad(c[:, 1:], (0, 0, 0, 1))
    start = None
    if x.states is not None:
        _, h, k_prev, v_prev = (f(t) for t in x.states)
        start = h + c[:, 0, :, None, None] * torch.einsum("brhp,brhn->bhpn", v_prev, k_prev)
    core = CoreArgs(q, k, v, adt, lam * dt + c_next, start, final)
    return Prepared(core, q, k, v, c_next, theta)


def correction(q, k, v, c_next) -> torch.Tensor:
    """c_{t+1} W_t q_{t,r} (B, L, R, H, P): what y_{t,r} = h'_t q_{t,r} holds beyond h_t q."""
    return c_next[:, :, None, :, None] * torch.einsum("blrhn,blshn,blshp->blrhp", q, k, v)


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
