"""`chunk_rwkv7`: RWKV-7's state update, drop-in for flash-linear-attention 0.6.0's
`fla.ops.rwkv7.chunk_rwkv7`. It is the DPLR delta rule (mecheval_kernels.dplr) in RWKV-7's
names (q is r, gk is w) with scale 1 by default, under its own custom ops
(`mecheval_kernels::rwkv7_fwd`, `_bwd`); reference, PyTorch path, Triton kernels and scan at
positions are mecheval_kernels.dplr's.
"""

from __future__ import annotations

import torch

from mecheval_kernels.dplr.op import check_hints, checked, family_op, refuse_packed, run

NAMES = {"q": "r", "gk": "w"}
OP = family_op("chunk_rwkv7", "rwkv7", NAMES)


def chunk_rwkv7(
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    safe_gate: bool = False,
    chunk_size: int | None = None,
    disable_recompute: bool = False,
    cp_context: object | None = None,
    lower_bound: float | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RWKV-7's state update, drop-in for `fla.ops.rwkv7.chunk_rwkv7` (fla 0.6.0).

    Per batch row and head, with a (K, V) state S:
    S_t = diag(exp(w_t)) S_{t-1} + b_t (a_t^T S_{t-1}) + k_t v_t^T; o_t = S_t^T (scale r_t)
    (RWKV-7's layer passes a = -kappa_hat, b = kappa_hat * a_gate).

    Args:
        r: (B, T, H, K) the receptance (the query).
        w: (B, T, H, K) the log decays: finite and <= 0 (checked on eager calls).
        k, a, b: (B, T, H, K), r's dtype; v (B, T, H, V).
        scale: the receptance scale (fla's default 1.0).
        initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu, safe_gate, chunk_size,
            disable_recompute, cp_context, lower_bound, backend: as
            `mecheval_kernels.chunk_dplr_delta_rule` takes them.

    Returns:
        (o (B, T, H, V) in r's dtype, the final state (B, H, K, V) in float32 or None). States
        after given steps, the output at one step, a patched state:
        `mecheval_kernels.at_positions(mecheval_kernels.chunk_rwkv7, ...)`.
    """
    refuse_packed(OP.public, cu_seqlens, cu_seqlens_cpu, cp_context, {})
    check_hints(OP.public, safe_gate, chunk_size, disable_recompute)
    args = checked(
        OP, backend, r, k, v, a, b, w, scale, initial_state, output_final_state, lower_bound,
        NAMES,
    )  # fmt: skip
    return run(OP, args, output_final_state)
