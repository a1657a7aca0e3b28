"""`at_positions_of_mamba2_scan`: Mamba-2's scan at positions (states after positions, the output at
one position per row, a patched state; mecheval_kernels.at_positions says what each means): states
and patches in its selective-scan form (mecheval_kernels.ssd.op.on_selective_scan), the output at
one position per row alone from `mamba2_scan` itself."""

from __future__ import annotations

import torch

from mecheval_kernels.scan_at import Asked, ScanAt
from mecheval_kernels.ssd.op import OP, checked, mamba2_scan, on_selective_scan
from mecheval_kernels.validation import check_state_patch, one_per_row

# mamba2_scan's inputs, in the order `checked` takes them after the backend.
SCAN_INPUTS = (
    "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "dt_softplus", "initial_states", "chunk_size",
    "dt_limit",
)  # fmt: skip


def at_positions_of_mamba2_scan(arguments: dict, asked: Asked) -> ScanAt:
    """`mamba2_scan`'s scan at positions (see mecheval_kernels.at_positions).

    Args:
        arguments: `mamba2_scan`'s arguments by name (x ... initial_states, chunk_size,
            dt_limit, backend; its packed-sequence arguments at their defaults).
        asked: what to return beside the output; the state is (B, H, P, N) float32 (`states`
            (B, K, H, P, N), patch values (B, H, P, N)), `out` at `out_at` (B, 1, H, P).

    Asked for no states and no patch, it runs `mamba2_scan` (the chunked form on the PyTorch
    path) and picks the output at `out_at`; else the selective scan at positions runs it (see
    mecheval_kernels.selective_scan.at for what runs where).
    """
    if asked.states_at is None and asked.state_patch is None:
        # The chunked form: several times the selective-scan form's speed on CPU, where the
        # output at one position per row is picked from the whole output (the patched runs of
        # an interchange grid ask for it from a resume point a few positions before).
        out, final = mamba2_scan(**{**arguments, "return_final_states": True})
        if asked.out_at is not None:
            x = arguments["x"]
            at = one_per_row(OP, "out_at", asked.out_at, x.shape[0], x.shape[1], x.device)
            out = out[torch.arange(x.shape[0], device=x.device), at][:, None]
        return ScanAt(out, final if asked.return_final_state else None, None)
    a, chosen = checked(arguments["backend"], *(arguments[name] for name in SCAN_INPUTS))
    if asked.state_patch is not None:
        x = a.x
        shape = (x.shape[0], *x.shape[2:], a.B.shape[3])
        patch = check_state_patch(OP, asked.state_patch, shape, x.shape[1], x.device)
        asked = asked._replace(state_patch=patch)
    return on_selective_scan(a, chosen, asked)
