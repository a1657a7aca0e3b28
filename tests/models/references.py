"""Oracles for the model tests: the Mamba and DeltaNet layers written straight from their
published equations, one position at a time, in float64, from a plain dict of parameters (the
names mamba-ssm and flash-linear-attention use). No `kernels` call, no mecheval layer code.

Both take an optional state patch: after position `positions[b]` of row b, the state is
replaced by `values[b]` and the recurrence continues from it (the output at that position was
already computed from the unpatched state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _f64(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().double() for k, v in params.items()}


def _linear(x: torch.Tensor, p: dict, name: str) -> torch.Tensor:
    y = x @ p[f"{name}.weight"].T
    bias = p.get(f"{name}.bias")
    return y if bias is None else y + bias


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """x (B, L, C), weight (C, 1, W): y[t] = bias + sum_i weight[:, 0, i] * x[t - W + 1 + i]."""
    B, L, C = x.shape
    W = weight.shape[-1]
    y = torch.zeros_like(x)
    for t in range(L):
        for i in range(W):
            s = t - W + 1 + i
            if s >= 0:
                y[:, t] += weight[:, 0, i] * x[:, s]
    return y if bias is None else y + bias


def _patch(h, t, patch):
    if patch is None:
        return h
    positions, values = patch
    rows = positions == t
    if rows.any():
        h = h.clone()
        h[rows] = values[rows].double()
    return h


def mamba_reference(params: dict, u: torch.Tensor, patch=None, use_conv: bool = True):
    """Mamba (Gu & Dao 2023, Algorithm 2 with mamba-ssm's parameterisation).

    params: in_proj.weight (2 Di, d), conv1d.weight (Di, 1, W), conv1d.bias (Di),
    x_proj.weight (R + 2N, Di), dt_proj.weight (Di, R), dt_proj.bias (Di), A_log (Di, N),
    D (Di), out_proj.weight (d, Di). u (B, L, d).

    Returns (out (B, L, d) float64, states (B, L, Di, N) float64, states after each position).
    """
    p = _f64(params)
    u = u.double()
    Di, N = p["A_log"].shape
    R = p["dt_proj.weight"].shape[1]
    x, z = _linear(u, p, "in_proj").split(Di, dim=-1)
    if use_conv:
        x = causal_depthwise_conv(x, p["conv1d.weight"], p.get("conv1d.bias"))
    x = F.silu(x)
    dt, Bm, Cm = _linear(x, p, "x_proj").split([R, N, N], dim=-1)
    delta = F.softplus(dt @ p["dt_proj.weight"].T + p["dt_proj.bias"])  # (B, L, Di)
    A = -torch.exp(p["A_log"])
    h = u.new_zeros(u.shape[0], Di, N)
    ys, states = [], []
    for t in range(u.shape[1]):
        dA = torch.exp(delta[:, t, :, None] * A)
        h = dA * h + delta[:, t, :, None] * Bm[:, t, None, :] * x[:, t, :, None]
        y = (h * Cm[:, t, None, :]).sum(-1) + p["D"] * x[:, t]
        ys.append(y * F.silu(z[:, t]))
        h = _patch(h, t, patch)
        states.append(h)
    out = _linear(torch.stack(ys, 1), p, "out_proj")
    return out, torch.stack(states, 1)


def delta_net_reference(
    params: dict, u: torch.Tensor, num_heads: int, patch=None, use_short_conv: bool = True
):
    """DeltaNet (Yang et al. 2024) as fla's layer computes it with qk_activation "silu",
    qk_norm "l2", use_beta, no gate.

    params: q_proj.weight, k_proj.weight, v_proj.weight, b_proj.weight, q_conv1d.weight,
    k_conv1d.weight, v_conv1d.weight (C, 1, W), o_norm.weight (V,), o_proj.weight. u (B, L, d).

    Returns (out (B, L, d) float64, states (B, L, H, K, V) float64).
    """
    p = _f64(params)
    u = u.double()
    B, L, _ = u.shape
    H = num_heads
    q, k, v = (_linear(u, p, f"{n}_proj") for n in "qkv")
    if use_short_conv:
        q, k, v = (
            causal_depthwise_conv(t, p[f"{n}_conv1d.weight"])
            for t, n in zip((q, k, v), "qkv", strict=True)
        )
    q, k, v = F.silu(q), F.silu(k), F.silu(v)
    q, k, v = (t.view(B, L, H, -1) for t in (q, k, v))
    q = q / q.norm(dim=-1, keepdim=True)
    k = k / k.norm(dim=-1, keepdim=True)
    beta = torch.sigmoid(_linear(u, p, "b_proj"))  # (B, L, H)
    K, V = q.shape[-1], v.shape[-1]
    S = u.new_zeros(B, H, K, V)
    outs, states = [], []
    for t in range(L):
        kt, vt, qt = k[:, t], v[:, t], q[:, t]
        delta = beta[:, t, :, None] * (vt - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, qt * K**-0.5))
        S = _patch(S, t, patch)
        states.append(S)
    o = torch.stack(outs, 1)  # (B, L, H, V)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * p["o_norm.weight"]
    out = _linear(o.reshape(B, L, H * V), p, "o_proj")
    return out, torch.stack(states, 1)
