"""The selective scan (Mamba's S6 recurrence), written for clarity: the oracle of the tests.

For each batch row b, channel d and state index n, one step at a time:

    dt_t = softplus(delta_t + delta_bias)     (each part only if asked for)
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t
    y_t  = sum_n h_t * C_t
    out  = (y + D * u) * silu(z)              (each term only if given)

B and C are each input-independent (D, N), input-dependent (B, N, L) or grouped (B, G, N, L),
where channel d reads group d // (D // G). h_{-1} is `initial_state` (or zero).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mecheval_kernels.scan_at import reference_result


def _at(X: torch.Tensor, t: int, channels: int) -> torch.Tensor:
    """B or C at position t, broadcastable to the state's shape (B, D, N)."""
    if X.dim() == 2:  # (D, N): the same at every position
        return X[None]
    if X.dim() == 3:  # (B, N, L): shared by every channel
        return X[:, None, :, t]
    groups = X.shape[1]  # (B, G, N, L): channel d reads group d // (D // G)
    return X[:, :, :, t].repeat_interleave(channels // groups, dim=1)


def selective_scan_ref(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None = None, z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
    return_last_state: bool = False, initial_state: torch.Tensor | None = None,
    states_at: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:  # fmt: skip
    """u, delta, z (B, D, L); A (D, N); B, C (D, N) | (B, N, L) | (B, G, N, L); D, delta_bias (D,);
    initial_state (B, D, N).

    Computes in float32 (float64 stays float64); returns out (B, D, L) in u's dtype, then, with
    `return_last_state`, the state after the last position, (B, D, N) in float32, then, with
    `states_at` (B, P) integer, the states after positions states_at[b, :] of each row b,
    (B, P, D, N) in float32.
    """
    compute = torch.float64 if u.dtype == torch.float64 else torch.float32
    batch, channels, length = u.shape
    u_c = u.to(compute)
    dt = delta.to(compute)
    if delta_bias is not None:
        dt = dt + delta_bias.to(compute)[:, None]
    if delta_softplus:
        dt = F.softplus(dt)
    A_c, B_c, C_c = A.to(compute), B.to(compute), C.to(compute)

    if initial_state is None:
        h = u.new_zeros(batch, channels, A.shape[1], dtype=compute)
    else:
        h = initial_state.to(compute)
    ys, states = [], []
    for t in range(length):
        dt_t = dt[:, :, t, None]  # (B, D, 1)
        h = torch.exp(dt_t * A_c) * h + dt_t * _at(B_c, t, channels) * u_c[:, :, t, None]
        ys.append((h * _at(C_c, t, channels)).sum(-1))
        states.append(h)
    out = torch.stack(ys, dim=-1)  # (B, D, L)
    if D is not None:
        out = out + D.to(compute)[:, None] * u_c
    if z is not None:
        out = out * F.silu(z.to(compute))
    return reference_result(out.to(u.dtype), h, states, return_last_state, states_at)
