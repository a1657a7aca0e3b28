"""The generalised delta rule with a diagonal-plus-low-rank transition (DPLR; RWKV-7's state
update), written for clarity as its per-step recurrence: the test oracle of
`chunk_dplr_delta_rule` and `chunk_rwkv7` (flash-linear-attention's `dplr_recurrence` computes
the same).

Per batch row and head, with a (K, V) matrix memory S and gk_t the per-key-channel log decay of
step t:

    u_t = S_{t-1}^T a_t                          # what the memory holds along a_t (a V row)
    S_t = diag(exp(gk_t)) S_{t-1} + b_t u_t^T + k_t v_t^T
    o_t = S_t^T (scale * q_t)                    # read with the query, after the write

so the transition is diag(exp(gk_t)) + b_t a_t^T (diagonal plus rank one). a_t reads the memory
before step t's decay. S_0 is `initial_state` (or zero). RWKV-7 uses a = -kappa_hat,
b = kappa_hat * a_gate (kappa_hat the normalised removal key): S_t = (diag(w_t) - kappa_hat
(kappa_hat * a_gate)^T) S_{t-1} + k_t v_t^T.
"""

from __future__ import annotations

import torch


def dplr_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    gk: torch.Tensor, scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, states_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """q, k, a, b, gk (B, T, H, K); v (B, T, H, V); initial_state (B, H, K, V).

    Computes in float32 (float64 stays float64). Returns o (B, T, H, V) in q's dtype and, with
    `output_final_state`, the state after the last step (B, H, K, V) in the compute dtype (else
    None), then, with `states_at` (B, P) integer, the states after steps states_at[b, :] of each
    row b, (B, P, H, K, V).
    """
    out_dtype = q.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    q, k, v, a, b, gk = (t.to(compute) for t in (q, k, v, a, b, gk))
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(compute)
    outputs, states = [], []
    for t in range(T):
        u = torch.einsum("bhk,bhkv->bhv", a[:, t], S)
        S = (
            torch.exp(gk[:, t])[..., None] * S
            + b[:, t, ..., None] * u[..., None, :]
            + k[:, t, ..., None] * v[:, t, ..., None, :]
        )
        outputs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
        states.append(S)
    o = torch.stack(outputs, dim=1).to(out_dtype)
    final = S if output_final_state else None
    if states_at is not None:
        rows = torch.arange(B, device=q.device)[:, None]
        return o, final, torch.stack(states, dim=1)[rows, states_at.to(q.device)]
    return o, final
