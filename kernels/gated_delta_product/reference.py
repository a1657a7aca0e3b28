"""Gated DeltaProduct written for clarity, as its per-token recurrence: the test oracle of
`chunk_gated_delta_product` (fla's `chunk_gated_delta_product` computes the same).

Per batch row and head, with a (K, V) memory S, each token t decays the memory once and then
writes n = num_householder corrections, each a delta-rule step with its own key, value and
strength (a product of n generalised Householder transitions a token); the query reads after
the last:

    S <- exp(g_t) S                                       # (gated only)
    for j in 1..n:
        u = beta_{t,j} (v_{t,j} - S^T k_{t,j}) ; S <- S + k_{t,j} u^T
    o_t = S^T (scale q_t)

k, v and beta hold the n steps of token t at rows t n, ..., t n + n - 1.
"""

from __future__ import annotations

import torch

from mecheval_kernels.delta_rule.reference import l2_normalize


def gated_delta_product_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
    beta: torch.Tensor, num_householder: int, scale: float | None = None,
    initial_state: torch.Tensor | None = None, output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False, states_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """q (B, T, H, K); k (B, T n, H, K); v (B, T n, H, V); g (B, T, H) or None; beta
    (B, T n, H); initial_state (B, H, K, V).

    Computes in float32 (float64 stays float64). Returns o (B, T, H, V) in q's dtype, the state
    after the last token (B, H, K, V) with `output_final_state` (else None), then, with
    `states_at` (B, P), the states after tokens states_at[b, :] (B, P, H, K, V).
    """
    out_dtype = q.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, K = q.shape
    n = num_householder
    scale = K**-0.5 if scale is None else scale
    q, k, v, beta = (t.to(compute) for t in (q, k, v, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    S = q.new_zeros(B, H, K, v.shape[-1]) if initial_state is None else initial_state.to(compute)
    outputs, states = [], []
    for t in range(T):
        if g is not None:
            S = torch.exp(g[:, t].to(compute))[..., None, None] * S
        for j in range(t * n, t * n + n):
            u = beta[:, j, :, None] * (v[:, j] - torch.einsum("bhk,bhkv->bhv", k[:, j], S))
            S = S + k[:, j, :, :, None] * u[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
        states.append(S)
    o = torch.stack(outputs, dim=1).to(out_dtype)
    final = S if output_final_state else None
    if states_at is not None:
        rows = torch.arange(B, device=q.device)[:, None]
        return o, final, torch.stack(states, dim=1)[rows, states_at.to(q.device)]
    return o, final
