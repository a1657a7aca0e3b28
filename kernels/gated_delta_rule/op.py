"""`chunk_gated_delta_rule`: the public gated-delta-rule op. It is the delta-rule family's
(mecheval_kernels.delta_rule.op) with the gate on: the same arguments, implementations and kernels,
with the log decays g, under its own custom ops (`mecheval_kernels::gated_delta_rule_fwd`, `_bwd`).
Both backends run the chunked algorithm at every length.
"""

from __future__ import annotations

import torch

from mecheval_kernels.delta_rule.op import Variant, family_op, run

OP = family_op("chunk_gated_delta_rule", "gated_delta_rule", gate="B T HV")
GATED_DELTA_RULE = Variant(
    OP,
    kwargs=frozenset({"chunk_size", "use_gate_in_kernel", "A_log", "dt_bias",
                      "transpose_state_layout"}),
)  # fmt: skip


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
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    chunk_indices: torch.LongTensor | None = None,
    cp_context: object | None = None,
    *,
    backend: str | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule (Gated DeltaNet), drop-in for flash-linear-attention 0.6.0's
    `fla.ops.gated_delta_rule.chunk_gated_delta_rule`.

    Per batch row and head, with a (K, V) state S: S' = exp(g_t) S_{t-1};
    u_t = beta_t (v_t - S'^T k_t); S_t = S' + k_t u_t^T; o_t = S_t^T (scale q_t).

    Args:
        g: (B, T, HV), the log decays: finite and <= 0 (a decaying memory, as a model's
            -exp(A_log) * softplus(...) is), both checked on eager calls (fla accepts
            positive values; here they are refused by name). With use_gate_in_kernel
            (in **kwargs) the raw gate input: g <- -exp(A_log) * softplus(g + dt_bias).
        use_beta_sigmoid_in_kernel: beta holds logits: beta <- sigmoid(beta).
        allow_neg_eigval: with use_beta_sigmoid_in_kernel, beta <- 2 sigmoid(beta) (in (0, 2)).
        state_v_first: initial and final states in the (B, HV, V, K) layout.
        cu_seqlens, cu_seqlens_cpu, chunk_indices, cp_context: fla's packed sequences and
            context parallelism; only None is supported (refused by name).
        **kwargs: use_gate_in_kernel, A_log (HV,), dt_bias (HV,), chunk_size (16, 32 or 64,
            checked, without effect here), transpose_state_layout (deprecated state_v_first).
            Anything else, head_first (removed in fla 0.6) included, is refused.
        the others: as `mecheval_kernels.chunk_delta_rule` takes them (q (B, T, H, K), k,
            v (B, T, HV, V), beta (B, T, HV), scale, initial_state, output_final_state,
            use_qk_l2norm_in_kernel, backend).

    Returns:
        (o, the final state or None) as `mecheval_kernels.chunk_delta_rule` returns them; g's
        gradient in g's dtype. States after given steps, the output at one step, a patched
        state: `mecheval_kernels.at_positions(mecheval_kernels.chunk_gated_delta_rule, ...)`.
    """
    return run(GATED_DELTA_RULE, locals())  # the arguments by name, as at_positions binds them
