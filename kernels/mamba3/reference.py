"""Mamba-3's scan (Lahoti et al. 2026, "Mamba-3"; mamba-ssm's `mamba3_siso_combined` and
`mamba3_mimo`) written for clarity as its per-step recurrence: the test oracle of
mecheval_kernels.mamba3.

Per batch row and head, with a (P, N) state h, MIMO rank R (R = 1: SISO) and the step's
rotation angle theta (one per rotated pair of state channels):

    theta_t = theta_{t-1} + pi tanh(angles_t) dt_t                   cumulative rotation
    q_{t,r} = rot(Q_{t,r} + Q_bias_r, theta_t) ; k_{t,r} = rot(K_{t,r} + K_bias_r, theta_t)
    v_{t,r} = V_t * mimo_v_r                                        (SISO: v = V)
    lam_t = sigmoid(trap_t) ; alpha_t = exp(adt_t)
    h_t = alpha_t h_{t-1} + (1 - lam_t) dt_t alpha_t sum_r v_{t-1,r} k_{t-1,r}^T
                          + lam_t dt_t sum_r v_{t,r} k_{t,r}^T       trapezoidal rule
    y_{t,r} = h_t q_{t,r} + D v_{t,r}
    y_{t,r} <- y_{t,r} * silu(Z_t * mimo_z_r)                       (with Z)
    (fused norm: y_{t,r} <- rmsnorm(y_{t,r}) * weight * silu(Z_t * mimo_z_r) instead)
    out_t = sum_r y_{t,r} * mimo_out_r                              (SISO: out = y)

rot turns channel pairs by theta: SISO's pairs are (2i, 2i + 1) for i < A (A = angles' last
size), the rest unturned; MIMO's ("halves") are (i, i + N/2) for i < A, with A = N/4 turning the
first and third quarters, A = N/2 every channel. k_{-1}, v_{-1} and h_{-1} come from the input
states (else zero); theta_{-1} too.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rotate(x: torch.Tensor, theta: torch.Tensor, pairs: str) -> torch.Tensor:
    """x (..., N) turned by theta (..., A): "pairwise" pairs (2i, 2i + 1), "halves" pairs
    (i, i + N/2), i < A; the other channels as they are."""
    A, N = theta.shape[-1], x.shape[-1]
    cos, sin = theta.cos(), theta.sin()
    if pairs == "pairwise":
        first, second = x[..., 0 : 2 * A : 2], x[..., 1 : 2 * A : 2]
        turned = torch.stack([first * cos - second * sin, first * sin + second * cos], dim=-1)
        return torch.cat([turned.flatten(-2), x[..., 2 * A :]], dim=-1)
    half = N // 2
    first, second = x[..., :A], x[..., half : half + A]
    out = x.clone()
    out[..., :A] = first * cos - second * sin
    out[..., half : half + A] = first * sin + second * cos
    return out


def mamba3_ref(
    Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, states=None,
    mimo_v=None, mimo_z=None, mimo_out=None, pairs="pairwise", norm=False, norm_weight=None,
    norm_eps=1e-5, states_at=None,
):  # fmt: skip
    """Q, K (B, L, R, G, N); V, Z (B, L, H, P); ADT, DT, Trap (B, H, L); Q_bias, K_bias (H, R, N);
    Angles (B, L, H, A); D (H,); states (theta (B, H, A), h (B, H, P, N), k (B, R, H, N),
    v (B, R, H, P): the last step's projected value) or None; mimo_* (H, R, P) (None: ones);
    norm: the fused norm (with Z), norm_weight (H, P) its weight (None: none).

    Computes in float32 (float64 stays float64). Returns (out (B, L, H, P), or (B, L, R, H, P)
    when mimo_out is None, in V's dtype; the final (theta, h, k, v)) and, with states_at (B, P')
    integer, the states h after those steps (B, P', H, P, N).
    """
    out_dtype = V.dtype
    dtype = torch.float64 if V.dtype == torch.float64 else torch.float32
    f = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z = map(
        f, (Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z)
    )
    B, L, R, G, N = Q.shape
    H, P = V.shape[2], V.shape[3]
    heads = lambda t: t.repeat_interleave(H // G, dim=-2)  # (.., G, N) -> (.., H, N)  # noqa: E731
    ones = V.new_ones(H, R, P)
    mimo_v = ones if mimo_v is None else f(mimo_v)
    mimo_z = ones if mimo_z is None else f(mimo_z)
    if states is None:
        theta = V.new_zeros(B, H, Angles.shape[-1])
        h, k_prev, v_prev = (
            V.new_zeros(B, H, P, N),
            V.new_zeros(B, R, H, N),
            V.new_zeros(B, R, H, P),
        )
    else:
        theta, h, k_prev, v_prev = (t.to(dtype) for t in states)
    outs, hs = [], []
    for t in range(L):
        dt, adt, lam = DT[:, :, t], ADT[:, :, t], torch.sigmoid(Trap[:, :, t])  # (B, H)
        theta = theta + math.pi * torch.tanh(Angles[:, t]) * dt[..., None]
        q = rotate(heads(Q[:, t]) + Q_bias.transpose(0, 1), theta[:, None], pairs)  # (B, R, H, N)
        k = rotate(heads(K[:, t]) + K_bias.transpose(0, 1), theta[:, None], pairs)
        v = V[:, t, None] * mimo_v.transpose(0, 1)  # (B, R, H, P)
        alpha = torch.exp(adt)
        write = lambda kk, vv: torch.einsum("brhp,brhn->bhpn", vv, kk)  # noqa: E731
        h = (
            alpha[..., None, None] * h
            + ((1 - lam) * dt * alpha)[..., None, None] * write(k_prev, v_prev)
            + (lam * dt)[..., None, None] * write(k, v)
        )
        y = torch.einsum("bhpn,brhn->brhp", h, q)
        if D is not None:
            y = y + D[:, None] * v
        if Z is not None:
            gate = F.silu(Z[:, t, None] * mimo_z.transpose(0, 1))
            if norm:
                y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + norm_eps)
                y = y if norm_weight is None else y * f(norm_weight)
            y = y * gate
        outs.append(y if mimo_out is None else (y * f(mimo_out).transpose(0, 1)).sum(1))
        hs.append(h)
        k_prev, v_prev = k, v
    out = torch.stack(outs, dim=1).to(out_dtype)
    final = (torch.remainder(theta, 2 * math.pi), h, k_prev, v_prev)
    if states_at is not None:
        rows = torch.arange(B, device=V.device)[:, None]
        return out, final, torch.stack(hs, dim=1)[rows, states_at.to(V.device)]
    return out, final
