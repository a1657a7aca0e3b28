"""Fused Triton kernels with PyTorch fallbacks, drop-in for the functions people already call.

    causal_conv1d_fn        drop-in for causal_conv1d.causal_conv1d_fn
    selective_scan_fn       drop-in for mamba_ssm's selective_scan_fn
    chunk_delta_rule        drop-in for fla.ops.delta_rule.chunk_delta_rule
    chunk_gated_delta_rule  drop-in for fla.ops.gated_delta_rule.chunk_gated_delta_rule
    mamba2_scan             drop-in for mamba_ssm's mamba_chunk_scan_combined (Mamba-2's scan)

and, beyond the peers, any of the four scans at positions (the states after given positions,
the output at one position per row, a state patched inside the scan), returning one `ScanAt`
whatever is asked (kernels.positions):

    at_positions(scan, *scan's arguments, states_at=, out_at=, state_patch=,
                 return_final_state=)

This package imports torch and triton only, never mecheval.
"""

from kernels.backend import get_backend, set_backend, use_backend
from kernels.delta_rule import chunk_delta_rule
from kernels.gated_delta_rule import chunk_gated_delta_rule
from kernels.positions import at_positions
from kernels.scan_at import ScanAt
from kernels.selective_scan import selective_scan_fn
from kernels.short_conv import causal_conv1d_fn
from kernels.ssd import mamba2_scan

__all__ = [
    "ScanAt",
    "at_positions",
    "causal_conv1d_fn",
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "get_backend",
    "mamba2_scan",
    "selective_scan_fn",
    "set_backend",
    "use_backend",
]
