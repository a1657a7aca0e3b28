"""`chunk_kda`: KDA, the delta-rule family's op with a decay per key channel (g (B, T, HV, K)),
under its own custom ops (`mecheval_kernels::kda_fwd`, `_bwd`). Reference, PyTorch path and Triton
kernels are mecheval_kernels.delta_rule's, the per-channel gate on."""

from __future__ import annotations

import torch

from mecheval_kernels.delta_rule.op import Variant, family_op, run

OP = family_op("chunk_kda", "kda", gate="B T HV K")
KDA = Variant(
    OP,
    kwargs=frozenset({"chunk_size", "A_log", "dt_bias", "transpose_state_layout"}),
    chunk_sizes=(32, 64),
)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context: object | None = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    *,
    backend: str | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA (Kimi Delta Attention), drop-in for flash-linear-attention 0.6.0's
    `fla.ops.kda.chunk_kda`.

    Per batch row and head, with a (K, V) state S and a decay per key channel:
    S' = diag(exp(g_t)) S_{t-1}; u_t = beta_t (v_t - S'^T k_t); S_t = S' + k_t u_t^T;
    o_t = S_t^T (scale q_t).

    Args:
        g: (B, T, HV, K), the log decays of each key channel: finite and <= 0 (checked on
            eager calls). With use_gate_in_kernel, the raw gate input:
            g <- -exp(A_log) * softplus(g + dt_bias), or, with lower_bound,
            lower_bound * sigmoid(exp(A_log) * (g + dt_bias)) (A_log None: without exp(A_log)).
        use_gate_in_kernel, lower_bound, safe_gate: the gate as above (safe_gate needs
            lower_bound in [-5, 0), as fla requires; it does not change the result here).
        use_beta_sigmoid_in_kernel, allow_neg_eigval: beta holds logits: beta <- sigmoid(beta),
            or 2 sigmoid(beta).
        state_v_first: initial and final states in the (B, HV, V, K) layout.
        disable_recompute: fla's memory/recompute trade-off; accepted, the result and what is
            saved here do not depend on it.
        return_intermediate_states, cu_seqlens, cu_seqlens_cpu, cp_context, use_graph,
            max_num_seqs: fla's inference states, packed sequences, context parallelism and
            CUDA-graph mode; only their defaults are supported (refused by name).
        **kwargs: A_log (HV,), dt_bias (HV * K,) for use_gate_in_kernel, chunk_size (32 or 64,
            checked, without effect here), transpose_state_layout (deprecated state_v_first).
            Anything else is refused.
        the others: as `mecheval_kernels.chunk_delta_rule` takes them (q, k (B, T, H, K),
            v (B, T, HV, V), beta (B, T, HV), scale, initial_state (B, HV, K, V),
            output_final_state, use_qk_l2norm_in_kernel, backend).

    Returns:
        (o (B, T, HV, V) in q's dtype, the final state (B, HV, K, V) float32 (float64 for
        float64 inputs) or None). States after given steps, the output at one step, a patched
        state: `mecheval_kernels.at_positions(mecheval_kernels.chunk_kda, ...)`.
    """
    return run(KDA, locals())  # the arguments by name, as at_positions binds them
