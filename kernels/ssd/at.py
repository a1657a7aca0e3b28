"""`at_positions_of_mamba2_scan`: Mamba-2's scan at positions (states after positions, the output
at one position per row, a patched state; kernels.at_positions says what each means), run in
its selective-scan form (kernels.ssd.op.on_selective_scan)."""

from __future__ import annotations

import torch

from kernels.scan_at import ScanAt
from kernels.ssd.op import OP, checked, mamba2_scan, on_selective_scan
from kernels.validation import check_state_patch

# mamba2_scan's inputs, in the order `checked` takes them after the backend.
SCAN_INPUTS = (
    "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "initial_states", "chunk_size",
    "dt_limit",
)  # fmt: skip


def at_positions_of_mamba2_scan(
    arguments: dict,
    *,
    states_at: torch.Tensor | None,
    out_at: torch.Tensor | None,
    state_patch: tuple[torch.Tensor, torch.Tensor] | None,
    return_final_state: bool,
) -> ScanAt:
    """`mamba2_scan`'s scan at positions (see kernels.at_positions).

    Args:
        arguments: `mamba2_scan`'s arguments by name (x ... initial_states, chunk_size,
            dt_limit, backend; its packed-sequence arguments at their defaults).
        states_at: optional (B, K) integer positions; `states` is then (B, K, H, P, N) float32.
        out_at: optional (B,) integer positions; `out` is then (B, 1, H, P).
        state_patch: optional (positions (B,), values (B, H, P, N)).
        return_final_state: return the state after the last position, (B, H, P, N) float32.

    Asked for nothing, it runs `mamba2_scan`; else the selective scan at positions runs it
    (see kernels.selective_scan.at for what runs where).
    """
    if states_at is None and out_at is None and state_patch is None:
        out, final = mamba2_scan(**{**arguments, "return_final_states": True})
        return ScanAt(out, final if return_final_state else None, None)
    a, chosen = checked(arguments["backend"], *(arguments[name] for name in SCAN_INPUTS))
    if state_patch is not None:
        x = a.x
        shape = (x.shape[0], *x.shape[2:], a.B.shape[3])
        state_patch = check_state_patch(OP, state_patch, shape, x.shape[1], x.device)
    return on_selective_scan(
        a,
        chosen,
        states_at=states_at,
        out_at=out_at,
        state_patch=state_patch,
        return_final_state=return_final_state,
    )
