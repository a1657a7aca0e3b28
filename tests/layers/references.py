"""Oracles for the model tests: the Mamba, Mamba-2, DeltaNet and Gated DeltaNet layers written
straight from their published equations, one position at a time, in float64, from a plain dict
of parameters (the names mamba-ssm and flash-linear-attention use). No `kernels` call, no
mecheval layer code.

The recurrent ones take an optional state patch: after position `positions[b]` of row b, the
state is replaced by `values[b]` and the recurrence continues from it (the output at that
position was already computed from the unpatched state).
"""

from __future__ import annotations

import math

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


def mamba2_reference(
    params: dict,
    u: torch.Tensor,
    headdim: int,
    ngroups: int = 1,
    patch=None,
    use_conv: bool = True,
    rmsnorm: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
):
    """Mamba-2 (Dao & Gu 2024) as mamba-ssm's `Mamba2` computes it (gated RMSNorm after the scan,
    norm_before_gate False), one position at a time; rmsnorm False: y * silu(z), no norm.

    params: in_proj.weight (2 Di + 2 G N + H, d) ([z, x, B, C, dt]), conv1d.weight
    (Di + 2 G N, 1, W), conv1d.bias, dt_bias (H,), A_log (H,), D (H,) or (Di,), norm.weight (Di,),
    out_proj.weight (d, Di). u (B, L, d).

    Returns (out (B, L, d) float64, states (B, L, H, P, N) float64).
    """
    p = _f64(params)
    u = u.double()
    Bsz, L, _ = u.shape
    H, P, G = p["A_log"].shape[0], headdim, ngroups
    Di = H * P
    N = (p["in_proj.weight"].shape[0] - 2 * Di - H) // (2 * G)
    z, xBC, dt = _linear(u, p, "in_proj").split([Di, Di + 2 * G * N, H], dim=-1)
    if use_conv:
        xBC = causal_depthwise_conv(xBC, p["conv1d.weight"], p.get("conv1d.bias"))
    x, Bm, Cm = F.silu(xBC).split([Di, G * N, G * N], dim=-1)
    x = x.view(Bsz, L, H, P)
    Bm, Cm = (t.view(Bsz, L, G, N).repeat_interleave(H // G, dim=2) for t in (Bm, Cm))
    dt = F.softplus(dt + p["dt_bias"]).clamp(*dt_limit)  # (B, L, H)
    A = -torch.exp(p["A_log"])
    D = p["D"].view(H, -1)  # (H, 1) or (H, P)
    h = u.new_zeros(Bsz, H, P, N)
    ys, states = [], []
    for t in range(L):
        decay = torch.exp(dt[:, t, :, None, None] * A[:, None, None])
        h = decay * h + dt[:, t, :, None, None] * x[:, t, :, :, None] * Bm[:, t, :, None, :]
        ys.append((h * Cm[:, t, :, None, :]).sum(-1) + D * x[:, t])
        h = _patch(h, t, patch)
        states.append(h)
    y = torch.stack(ys, 1).reshape(Bsz, L, Di) * F.silu(z)
    if rmsnorm:
        y = y.view(Bsz, L, G, Di // G)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
        y = y.reshape(Bsz, L, Di) * p["norm.weight"]
    out = _linear(y, p, "out_proj")
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


def gated_delta_net_reference(
    params: dict, u: torch.Tensor, num_heads: int, patch=None, use_short_conv: bool = True
):
    """Gated DeltaNet (Yang et al. 2024) as fla's `GatedDeltaNet` layer computes it (use_gate,
    one value head per key head): g = -exp(A_log) softplus(u W_a + dt_bias), beta =
    sigmoid(u W_b), S_t = exp(g_t) S_{t-1} then the delta-rule write, output through a gated
    RMSNorm (x / rms(x) * weight * silu(u W_g)).

    params: q_proj, k_proj, v_proj, a_proj, b_proj, g_proj, o_proj .weight, A_log, dt_bias (H,),
    q_conv1d, k_conv1d, v_conv1d .weight (C, 1, W), o_norm.weight (V,). u (B, L, d).

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
    q, k, v = (F.silu(t).view(B, L, H, -1) for t in (q, k, v))
    q = q / q.norm(dim=-1, keepdim=True)
    k = k / k.norm(dim=-1, keepdim=True)
    g = -torch.exp(p["A_log"]) * F.softplus(_linear(u, p, "a_proj") + p["dt_bias"])  # (B, L, H)
    beta = torch.sigmoid(_linear(u, p, "b_proj"))
    K, V = q.shape[-1], v.shape[-1]
    S = u.new_zeros(B, H, K, V)
    outs, states = [], []
    for t in range(L):
        kt, vt, qt = k[:, t], v[:, t], q[:, t]
        S = torch.exp(g[:, t, :, None, None]) * S
        delta = beta[:, t, :, None] * (vt - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, qt * K**-0.5))
        S = _patch(S, t, patch)
        states.append(S)
    o = torch.stack(outs, 1)  # (B, L, H, V)
    gate = _linear(u, p, "g_proj").view(B, L, H, V)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * p["o_norm.weight"]
    out = _linear((o * F.silu(gate)).reshape(B, L, H * V), p, "o_proj")
    return out, torch.stack(states, 1)


def h3_reference(params: dict, u: torch.Tensor, head_dim: int) -> torch.Tensor:
    """H3 (Fu et al. 2023) as recurrences, one position at a time, in float64.

    Shift SSM per channel: state s_t = shift(s_{t-1}) + B u_t (shift moves every entry one
    slot down and drops the last), output C . s_t + D_shift u_t. Diagonal SSM per head on
    each entry of k v^T: complex modes x_t = dA x_{t-1} + dB w_t with the bilinear dA, dB of
    A = -exp(inv_A_real) + i A_imag and dt = exp(log_dt), output 2 Re(C . x_t) + D w_t.

    params: q_proj/k_proj/v_proj/output_linear .weight/.bias, shift_B, shift_C (d, N),
    shift_D (d,), log_dt (H,), inv_A_real, A_imag (H, M), B, C (H, M, 2) (real, imag), D (H,).
    """
    p = _f64(params)
    u = u.double()
    Bsz, L, d = u.shape
    P = head_dim
    H = d // P
    q, k, v = (_linear(u, p, f"{n}_proj") for n in "qkv")
    s = u.new_zeros(Bsz, d, p["shift_B"].shape[1])
    shifted = []
    for t in range(L):
        s = (
            torch.cat([s.new_zeros(Bsz, d, 1), s[..., :-1]], dim=-1)
            + p["shift_B"] * k[:, t, :, None]
        )
        shifted.append((s * p["shift_C"]).sum(-1) + p["shift_D"] * k[:, t])
    k = torch.stack(shifted, 1)
    kv = k.view(Bsz, L, H, P, 1) * v.view(Bsz, L, H, 1, P)  # (B, L, H, i, j)
    dt = torch.exp(p["log_dt"])[:, None]
    A = torch.complex(-torch.exp(p["inv_A_real"]), p["A_imag"])
    dA = (1 + dt * A / 2) / (1 - dt * A / 2)  # (H, M)
    dB = torch.view_as_complex(p["B"].contiguous()) * dt / (1 - dt * A / 2)
    C = torch.view_as_complex(p["C"].contiguous())
    x = torch.zeros(Bsz, H, P, P, A.shape[1], dtype=torch.complex128)
    outs = []
    for t in range(L):
        w = kv[:, t]  # (B, H, i, j)
        x = dA[None, :, None, None, :] * x + dB[None, :, None, None, :] * w[..., None]
        y = 2 * (C[None, :, None, None, :] * x).sum(-1).real + p["D"][None, :, None, None] * w
        outs.append((q[:, t].view(Bsz, H, P, 1) * y).sum(2).reshape(Bsz, d))
    return _linear(torch.stack(outs, 1), p, "output_linear")


def positional_encoding_reference(l_max: int) -> torch.Tensor:
    """z(t) = [t / (l_max - 1), cos(1e-4 w_t), -sin(1e-4 w_t)], w_t = 2 pi t / l_max (one band),
    float64 (l_max, 3)."""
    t = torch.arange(l_max, dtype=torch.float64)
    w = 2 * torch.pi * t / l_max
    return torch.stack([t / (l_max - 1), torch.cos(1e-4 * w), -torch.sin(1e-4 * w)], dim=-1)


def causal_long_conv_loop(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """y[:, t] = sum_{s <= t} h[s] * u[:, t - s], u (B, L, C), h (>= L, C)."""
    y = torch.zeros_like(u)
    for t in range(u.shape[1]):
        for s in range(t + 1):
            y[:, t] += h[s] * u[:, t - s]
    return y


def hyena_reference(params: dict, u: torch.Tensor, l_max: int) -> torch.Tensor:
    """Order-2 Hyena as zoology builds it (skip D off), float64: in_proj, short depthwise conv
    of width 3, split into x1, x2, v; v * x1 convolved with the implicit filter h(t) =
    MLP(z(t)) * exp(-t/(l_max-1) |delta_c|) (MLP: Linear, sin, Linear, sin, Linear, sin, Linear;
    delta spread linearly from log(1e-2)/1.5 to log(1e-2)/0.3 over channels); times x2;
    out_proj."""
    p = _f64(params)
    u = u.double()
    d = u.shape[-1]
    x = _linear(u, p, "in_proj")
    x = causal_depthwise_conv(x, p["short_filter.weight"], p["short_filter.bias"])
    x1, x2, v = x.split(d, dim=-1)
    z = p["filter_fn.z"]
    f = p["filter_fn.implicit_filter.1.freq"]
    h = torch.sin(f * _linear(z, p, "filter_fn.implicit_filter.0"))
    h = torch.sin(f * _linear(h, p, "filter_fn.implicit_filter.2"))
    h = torch.sin(f * _linear(h, p, "filter_fn.implicit_filter.4"))
    h = _linear(h, p, "filter_fn.implicit_filter.6")
    deltas = torch.linspace(math.log(1e-2) / 1.5, math.log(1e-2) / 0.3, d, dtype=torch.float64)
    t = torch.arange(l_max, dtype=torch.float64)[:, None] / (l_max - 1)
    h = h * torch.exp(-t * deltas.abs())
    y = causal_long_conv_loop(v * x1, h)
    return _linear(y * x2, p, "out_proj")


def base_conv_long_reference(params: dict, u: torch.Tensor) -> torch.Tensor:
    """BaseConv with its implicit long conv, float64: y = (h * u + u) * (u W + b) + u, with
    h(t) = Linear(ReLU(Linear(z(t)))) (zoology's ImplicitLongConvolution, no decay)."""
    p = _f64(params)
    u = u.double()
    h = _linear(torch.relu(_linear(p["conv.z"], p, "conv.mlp.0")), p, "conv.mlp.2")
    conv = causal_long_conv_loop(u, h) + u
    return conv * _linear(u, p, "projection") + u
