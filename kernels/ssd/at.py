"""`mamba2_scan_at`: Mamba-2's scan at positions (states after positions, the output at one
position per row, a patched state; kernels.scan_at says what each means), run in its
selective-scan form (kernels.selective_scan_at)."""

from __future__ import annotations

import torch

from kernels.scan_at import ScanAt
from kernels.ssd.op import OP, checked, mamba2_scan, on_selective_scan
from kernels.validation import check_state_patch


def mamba2_scan_at(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    initial_states: torch.Tensor | None = None,
    *,
    states_at: torch.Tensor | None = None,
    out_at: torch.Tensor | None = None,
    state_patch: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_final_state: bool = False,
    backend: str | None = None,
) -> ScanAt:
    """`mamba2_scan`'s scan at positions (see kernels.scan_at).

    Args:
        x ... initial_states: as `mamba2_scan` takes them.
        states_at: optional (B, K) integer positions; `states` is then (B, K, H, P, N) float32.
        out_at: optional (B,) integer positions; `out` is then (B, 1, H, P).
        state_patch: optional (positions (B,), values (B, H, P, N)).
        return_final_state: return the state after the last position, (B, H, P, N) float32.
        backend: "auto", "triton" or "torch"; None uses the process default.

    Asked for nothing, it runs `mamba2_scan`; else the selective scan at positions runs it
    (see `kernels.selective_scan_at` for what runs where).
    """
    if states_at is None and out_at is None and state_patch is None:
        result = mamba2_scan(
            x, dt, A, B, C, None, D, z, dt_bias, initial_states, dt_softplus=dt_softplus,
            return_final_states=True, backend=backend,
        )  # fmt: skip
        return ScanAt(result[0], result[1] if return_final_state else None, None)
    a, chosen = checked(backend, x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_states, None)
    if state_patch is not None:
        shape = (x.shape[0], *x.shape[2:], B.shape[3])
        state_patch = check_state_patch(OP, state_patch, shape, x.shape[1], x.device)
    return on_selective_scan(a, chosen, states_at, out_at, state_patch, return_final_state)
