"""`chunk_comba`: Comba, the delta-rule family's op with a recall key p read before the step's
decay (a transition exp(g_t) I - beta_t k_t p_t^T), under its own custom ops
(`mecheval_kernels::comba_fwd`, `_bwd`). Reference, PyTorch path and Triton kernels are
mecheval_kernels.delta_rule's with p given.

It computes what fla's `chunk_comba` and `fused_recurrent_comba` compute (and fla's
`naive_chunk_comba`); fla 0.6.0's `naive_recurrent_comba` decays before the recall, unlike
fla's kernels, and is not its oracle here (docs/kernels.md).
"""

from __future__ import annotations

import torch

from mecheval_kernels.delta_rule.op import Variant, family_op, run
from mecheval_kernels.delta_rule.reference import gated_delta_rule_ref

OP = family_op("chunk_comba", "comba", gate="B T HV")
COMBA = Variant(OP, kwargs=frozenset(), chunk_sizes=())


def comba_ref(q, k, v, p, g, beta, *args, **kwargs) -> tuple[torch.Tensor, ...]:
    """Comba's per-step reference: the family's (`gated_delta_rule_ref`) with the recall key p,
    on chunk_comba's arguments (scale, initial_state, output_final_state,
    use_qk_l2norm_in_kernel, states_at after beta)."""
    return gated_delta_rule_ref(q, k, v, g, beta, *args, p=k if p is None else p, **kwargs)


def arguments_of(arguments: dict) -> dict:
    """chunk_comba's arguments as the family takes them: p defaults to k (as in fla); beta is
    required (fla's default None does not run)."""
    if arguments["beta"] is None:
        raise ValueError("chunk_comba: beta must be a (B, T, HV) tensor, got None")
    return dict(arguments, p=arguments["k"] if arguments["p"] is None else arguments["p"])


def chunk_comba(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    p: torch.Tensor | None,
    g: torch.Tensor,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Comba, drop-in for flash-linear-attention 0.6.0's `fla.ops.comba.chunk_comba`.

    Per batch row and head, with a (K, V) state S: u_t = beta_t (v_t - S_{t-1}^T p_t);
    S_t = exp(g_t) S_{t-1} + k_t u_t^T; o_t = S_t^T (scale q_t).

    Args:
        q, k: (B, T, H, K) float32/float16/bfloat16 (float64 on the PyTorch path).
        v: (B, T, HV, V), q's dtype; HV a multiple of H (GVA).
        p: (B, T, H, K), q's dtype, the recall key; None means k (the gated delta rule with
            the recall before the decay).
        g: (B, T, HV), the log decays: finite and <= 0 (checked on eager calls).
        beta: (B, T, HV), the write strengths; required (fla's default None does not run).
        use_qk_l2norm_in_kernel: L2-normalise q, k and p over K inside the op.
        cu_seqlens, cu_seqlens_cpu: fla's packed sequences; only None is supported.
        the others: as `mecheval_kernels.chunk_delta_rule` takes them (scale, initial_state
            (B, HV, K, V), output_final_state, backend).

    Returns:
        (o (B, T, HV, V) in q's dtype, the final state (B, HV, K, V) float32 (float64 for
        float64 inputs) or None). States after given steps, the output at one step, a patched
        state: `mecheval_kernels.at_positions(mecheval_kernels.chunk_comba, ...)`.
    """
    return run(COMBA, arguments_of(locals()))
