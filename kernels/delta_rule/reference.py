"""The delta-rule family written for clarity, as its per-step recurrence: the test oracle of the
delta rule (DeltaNet), the gated delta rule (Gated DeltaNet, Yang et al. 2024), KDA (Kimi Delta
Attention: a decay per key channel) and Comba (a recall key p, read before the decay); fla's
`chunk_gated_delta_rule`, `chunk_kda` and `chunk_comba` compute the same.

Per batch row and head, with a (K, V) matrix memory S and g_t the log decay of step t:

    S'_{t-1} = diag(exp(g_t)) S_{t-1}          # forget: decay the memory (gated only); g_t is
                                               # one number per head, or one per key row (KDA)
    u_t = beta_t * (v_t - S'_{t-1}^T k_t)      # the error between the value and what S' recalls
    S_t = S'_{t-1} + k_t u_t^T                 # write the correction under key k_t
    o_t = S_t^T (scale * q_t)                  # read with the query, after the write

Comba recalls with its own key p_t from the memory before the decay:
u_t = beta_t * (v_t - S_{t-1}^T p_t), then S_t = S'_{t-1} + k_t u_t^T (a transition
exp(g_t) I - beta_t k_t p_t^T).

S_0 is `initial_state` (or zero); scale defaults to K ** -0.5. The delta rule is the gated delta
rule with no gate (g = None: S'_{t-1} = S_{t-1}).
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (fla's `l2norm`), in x's dtype."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2NORM_EPS)


def gated_delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None,
    beta: torch.Tensor, scale: float | None = None, initial_state: torch.Tensor | None = None,
    output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
    states_at: torch.Tensor | None = None, p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """q, k (B, T, H, K); v (B, T, H, V); g (the log decays (B, T, H), (B, T, H, K) for a decay
    per key channel, or None: no gate), beta (B, T, H); initial_state (B, H, K, V); p (B, T, H, K)
    Comba's recall key (None: recall with k after the decay).

    Computes in float32 (float64 stays float64). Returns o (B, T, H, V) in q's dtype and, with
    `output_final_state`, the state after the last step (B, H, K, V) in the compute dtype (else
    None), then, with `states_at` (B, P) integer, the states after steps states_at[b, :] of each
    row b, (B, P, H, K, V).
    """
    out_dtype = q.dtype
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    q, k, v, beta = (t.to(compute) for t in (q, k, v, beta))
    g = None if g is None else g.to(compute)
    p = None if p is None else p.to(compute)
    if use_qk_l2norm_in_kernel:  # Comba normalises its recall key too, as fla's kernels do
        q, k = l2_normalize(q), l2_normalize(k)
        p = None if p is None else l2_normalize(p)
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(compute)
    outputs, states = [], []
    for t in range(T):
        k_t, v_t, q_t, beta_t = k[:, t], v[:, t], q[:, t], beta[:, t, :, None]
        if p is not None:  # Comba: recall before the decay
            recalled = torch.einsum("bhk,bhkv->bhv", p[:, t], S)
        if g is not None:
            decay = g[:, t, :, None, None] if g.dim() == 3 else g[:, t, :, :, None]
            S = torch.exp(decay) * S
        if p is None:
            recalled = torch.einsum("bhk,bhkv->bhv", k_t, S)
        u_t = beta_t * (v_t - recalled)
        S = S + k_t[..., :, None] * u_t[..., None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", scale * q_t, S))
        states.append(S)
    o = torch.stack(outputs, dim=1).to(out_dtype)
    if states_at is not None:
        rows = torch.arange(B, device=q.device)[:, None]
        picked = torch.stack(states, dim=1)[rows, states_at.to(q.device)]
        return o, (S if output_final_state else None), picked
    return o, (S if output_final_state else None)


def delta_rule_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *args, **kwargs
) -> tuple[torch.Tensor, ...]:
    """The delta rule: `gated_delta_rule_ref` with no gate, on its arguments but g (scale,
    initial_state, output_final_state, use_qk_l2norm_in_kernel, states_at)."""
    return gated_delta_rule_ref(q, k, v, None, beta, *args, **kwargs)
