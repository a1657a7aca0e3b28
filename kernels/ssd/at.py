"""`at_positions_of_mamba2_scan`: Mamba-2's scan at positions (states after positions, the output at
one position per row, a patched state; mecheval_kernels.at_positions says what each means).

On the PyTorch path, for inputs known to be all finite (mecheval_kernels.ssd.chunked.finite_inputs:
on CPU, outside torch.compile), everything runs in the chunked form, differentiated by autograd:
a state after a position from the state entering its chunk, the output at one position per row
from its chunk's row of the masked matrix, a patched state as the unpatched scan plus its
jump, which for Mamba-2 has a closed form (one decay per head: the jump d after position p is
exp(A_h (dt_{p+1} + ... + dt_t)) d at t, read through C_t and the gate). Otherwise the output
alone runs `mamba2_scan`'s op, and states and patches run Mamba-2 as a selective scan
(mecheval_kernels.ssd.op.on_selective_scan).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mecheval_kernels.scan_at import Asked, ScanAt, patch_by_jump
from mecheval_kernels.ssd.chunked import Inputs, finite_inputs, ssd_chunked_states
from mecheval_kernels.ssd.op import NAME, checked, on_selective_scan, run
from mecheval_kernels.ssd.reference import step_sizes
from mecheval_kernels.validation import check_positions, check_state_patch, one_per_row

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
    """
    a, chosen = checked(arguments["backend"], *(arguments[name] for name in SCAN_INPUTS))
    batch, length, heads, P = a.x.shape
    device = a.x.device
    read = asked.states_at
    read = None if read is None else check_positions(NAME, read, batch, length, device)
    if asked.state_patch is not None:
        shape = (batch, heads, P, a.B.shape[3])
        patch = check_state_patch(NAME, asked.state_patch, shape, length, device)
        asked = asked._replace(state_patch=patch)
    one = asked.out_at
    one = None if one is None else one_per_row(NAME, "out_at", one, batch, length, device)
    asked = asked._replace(states_at=read, out_at=one)
    if chosen == "triton" or not finite_inputs(a):
        if read is None and asked.state_patch is None:  # the output (and final state) alone
            out, final = run(a, chosen)
            out = out if one is None else out[torch.arange(batch, device=device), one][:, None]
            return ScanAt(out, final if asked.return_final_state else None, None)
        return on_selective_scan(a, chosen, asked)
    unpatched = functools.partial(_unpatched, a)
    if asked.state_patch is None:
        return unpatched(read, one, asked.return_final_state)
    positions, values = asked.state_patch
    jump = functools.partial(_jump, a)
    return patch_by_jump(
        unpatched, jump, positions, values, read, one, asked.return_final_state, length, 1
    )


def _unpatched(a: Inputs, read, one, return_final_state: bool) -> ScanAt:
    """The chunked scan with the states after `read` (B, K) and the output at `one` (B,)."""
    return ScanAt(*ssd_chunked_states(a, read, one, return_final_state))


def _jump(a: Inputs, start, after, read, one, return_final_state: bool) -> ScanAt:
    """The scan with no inputs from state `start` (B, H, P, N), holding still wherever `after`
    (B, L) is False: the state at t is exp(A_h (sum of the steps that move up to t)) start, its
    output C_t . state_t through the gate (no skip: there is no input)."""
    batch, length, heads, P = a.x.shape
    groups, N = a.B.shape[2:]
    step = step_sizes(a.dt, a.dt_bias, a.dt_softplus, start.dtype)
    full = torch.exp((step * a.A.to(start.dtype) * after[..., None]).cumsum(dim=1))  # (B, L, H)
    start_g = start.view(batch, groups, heads // groups, P, N)
    C, z, decay = a.C.to(start.dtype), a.z, full
    if one is not None:  # the one position per row alone
        rows = torch.arange(batch, device=start.device)
        C, decay = C[rows, one][:, None], full[rows, one][:, None]
        z = None if z is None else z[rows, one][:, None]
    out = torch.einsum("blgn,bgrpn->blgrp", C, start_g).reshape(*decay.shape, P)
    out = out * decay[..., None]
    if z is not None:
        out = out * F.silu(z.to(out.dtype))
    final = full[:, -1, :, None, None] * start if return_final_state else None
    states = None
    if read is not None:
        rows = torch.arange(batch, device=start.device)[:, None]
        states = full[rows, read][..., None, None] * start[:, None]
    return ScanAt(out, final, states)
