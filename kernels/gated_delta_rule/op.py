"""`chunk_gated_delta_rule`: the public gated-delta-rule op. It is the delta-rule family's
(mecheval_kernels.delta_rule.op) with the gate on: the same arguments, implementations and kernels,
with the log decays g, under its own custom ops (`mecheval_kernels::gated_delta_rule_fwd`, `_bwd`).
Both backends run the chunked algorithm at every length.
"""

from __future__ import annotations

import torch

from mecheval_kernels.delta_rule.op import family_op, run

OP = family_op("chunk_gated_delta_rule", "gated_delta_rule")


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    head_first: bool = False,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule (Gated DeltaNet), drop-in for
    `fla.ops.gated_delta_rule.chunk_gated_delta_rule`.

    Per batch row and head, with a (K, V) state S: S' = exp(g_t) S_{t-1};
    u_t = beta_t (v_t - S'^T k_t); S_t = S' + k_t u_t^T; o_t = S_t^T (scale q_t).

    Args:
        g: (B, T, H), the log decays: finite and <= 0 (a decaying memory, as a model's
            -exp(A_log) * softplus(...) is), both checked on eager calls (fla accepts
            positive values; here they are refused by name).
        the others: as `mecheval_kernels.chunk_delta_rule` takes them (q (B, T, H, K), k, v, beta,
            scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            head_first, backend).

    Returns:
        (o, the final state or None) as `mecheval_kernels.chunk_delta_rule` returns them; g's
        gradient
        in g's dtype. States after given steps, the output at one step, a patched state:
        `mecheval_kernels.at_positions(mecheval_kernels.chunk_gated_delta_rule, ...)`.
    """
    return run(OP, backend, q, k, v, g, beta, scale, initial_state, output_final_state,
               use_qk_l2norm_in_kernel, cu_seqlens, head_first)  # fmt: skip
