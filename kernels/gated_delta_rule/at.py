"""`chunk_gated_delta_rule_at`: the gated delta rule at positions (states after steps, the
output at one step per row, a patched state; kernels.scan_at says what each means), run by the
family's scan at positions (kernels.delta_rule.at), with the log decays held still where a jump
waits."""

from __future__ import annotations

import torch

from kernels.delta_rule.at import scan_at
from kernels.delta_rule.op import checked
from kernels.gated_delta_rule.op import OP
from kernels.scan_at import ScanAt


def chunk_gated_delta_rule_at(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    states_at: torch.Tensor | None = None,
    out_at: torch.Tensor | None = None,
    state_patch: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_final_state: bool = False,
    backend: str | None = None,
) -> ScanAt:
    """`chunk_gated_delta_rule`'s scan at positions (see kernels.scan_at): its arguments, then
    `states_at` (B, P), `out_at` (B,), `state_patch` (positions (B,), values (B, H, K, V)) and
    `return_final_state`, as `kernels.chunk_delta_rule_at` takes them."""
    a, chosen = checked(
        OP, backend, q, k, v, g, beta, scale, initial_state, return_final_state,
        use_qk_l2norm_in_kernel,
    )  # fmt: skip
    return scan_at(OP, a, chosen, states_at, out_at, state_patch)
