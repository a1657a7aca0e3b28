"""Mamba-2's scan (the SSD layer's recurrence, Dao & Gu 2024), written for clarity: the oracle
of the tests.

Heads h = 0..H-1 of P channels each; groups g = 0..G-1 of B and C, head h reading group
h // (H / G). For each batch row, head h, channel p and state index n, one step at a time:

    dt_t = softplus(dt_t + dt_bias)           (each part only if asked for)
    h_t  = exp(dt_t * A_h) * h_{t-1} + dt_t * x_t * B_t      state (P, N) per head
    y_t  = h_t C_t                                            (P,)
    out  = (y + D * x) * silu(z)              (each term only if given)

A is one scalar per head, shared by its channels and state indices (Mamba's is one per channel
and state index); dt one per head; D one per head or per channel (H, P). h_{-1} is
`initial_states` (or zero).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mecheval_kernels.scan_at import reference_result


def step_sizes(
    dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, compute: torch.dtype
) -> torch.Tensor:
    """The steps (B, L, H) in `compute`: dt + dt_bias, through softplus with `dt_softplus`."""
    step = dt.to(compute)
    if dt_bias is not None:
        step = step + dt_bias.to(compute)
    return F.softplus(step) if dt_softplus else step


def mamba2_scan_ref(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
    initial_states: torch.Tensor | None = None, return_final_states: bool = False,
    states_at: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:  # fmt: skip
    """x, z (B, L, H, P); dt (B, L, H); A, dt_bias (H,); B, C (B, L, G, N); D (H,) or (H, P);
    initial_states (B, H, P, N).

    Computes in float32 (float64 stays float64); returns out (B, L, H, P) in x's dtype, then,
    with `return_final_states`, the state after the last position (B, H, P, N) float32, then,
    with `states_at` (B, K) integer, the states after positions states_at[b, :] of each row b,
    (B, K, H, P, N) float32.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    batch, length, heads, _ = x.shape
    per_group = heads // B.shape[2]
    x_c = x.to(compute)
    step = step_sizes(dt, dt_bias, dt_softplus, compute)
    A_c = A.to(compute)
    # Each head's copy of its group's B and C: (B, L, H, N).
    B_h = B.to(compute).repeat_interleave(per_group, dim=2)
    C_h = C.to(compute).repeat_interleave(per_group, dim=2)

    if initial_states is None:
        h = x.new_zeros(batch, heads, x.shape[3], B.shape[3], dtype=compute)
    else:
        h = initial_states.to(compute)
    ys, states = [], []
    for t in range(length):
        dt_t = step[:, t, :, None, None]  # (B, H, 1, 1)
        decay = torch.exp(dt_t * A_c[:, None, None])
        h = decay * h + dt_t * x_c[:, t, :, :, None] * B_h[:, t, :, None, :]
        ys.append((h * C_h[:, t, :, None, :]).sum(-1))  # (B, H, P)
        states.append(h)
    out = torch.stack(ys, dim=1)  # (B, L, H, P)
    if D is not None:
        skip = D.to(compute)
        out = out + (skip[:, None] if skip.dim() == 1 else skip) * x_c
    if z is not None:
        out = out * F.silu(z.to(compute))
    return reference_result(out.to(x.dtype), h, states, return_final_states, states_at)
