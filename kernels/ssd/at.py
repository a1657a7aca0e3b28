"""`at_positions_of_mamba2_scan`: Mamba-2's scan at positions (states after positions, the output at
one position per row, a patched state; mecheval_kernels.at_positions says what each means), run in
its selective-scan form (mecheval_kernels.ssd.op.on_selective_scan)."""

from __future__ import annotations

from mecheval_kernels.scan_at import Asked, ScanAt
from mecheval_kernels.ssd.op import OP, checked, mamba2_scan, on_selective_scan
from mecheval_kernels.validation import check_state_patch

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

    Asked for nothing, it runs `mamba2_scan`; else the selective scan at positions runs it
    (see mecheval_kernels.selective_scan.at for what runs where).
    """
    if asked.states_at is None and asked.out_at is None and asked.state_patch is None:
        out, final = mamba2_scan(**{**arguments, "return_final_states": True})
        return ScanAt(out, final if asked.return_final_state else None, None)
    a, chosen = checked(arguments["backend"], *(arguments[name] for name in SCAN_INPUTS))
    if asked.state_patch is not None:
        x = a.x
        shape = (x.shape[0], *x.shape[2:], a.B.shape[3])
        patch = check_state_patch(OP, asked.state_patch, shape, x.shape[1], x.device)
        asked = asked._replace(state_patch=patch)
    return on_selective_scan(a, chosen, asked)
