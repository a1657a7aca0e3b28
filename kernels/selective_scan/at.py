"""`at_positions_of_selective_scan`: the selective scan at positions (states after positions, the
output at one position per row, a patched state; mecheval_kernels.at_positions says what each
means)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from mecheval_kernels._op import needs_grad
from mecheval_kernels.scan_at import Asked, ScanAt, patch_by_jump
from mecheval_kernels.selective_scan.op import OP, ScanArgs, checked, selective_scan_fn
from mecheval_kernels.validation import check_positions, check_state_patch, one_per_row

# selective_scan_fn's inputs, in the order `checked` takes them after the backend.
SCAN_INPUTS = (
    "u", "delta", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus", "initial_state",
)  # fmt: skip


def at_positions_of_selective_scan(arguments: dict, asked: Asked) -> ScanAt:
    """`selective_scan_fn`'s scan at positions (see mecheval_kernels.at_positions).

    Args:
        arguments: `selective_scan_fn`'s arguments by name (u ... initial_state, backend).
        asked: what to return beside the output; the state is (B, D, N) float32 (`states`
            (B, P, D, N), patch values (B, D, N)), `out` at `out_at` (B, D, 1).

    Without gradients, states and patches run on the PyTorch path (on any device: the Triton
    kernels keep the state on chip), in one pass; the output at `out_at` alone is formed
    there (the contraction with C, the skip and the gate at those positions only). With
    gradients, states come from one call per position (slow, exact) and a patch from the
    unpatched scan plus the scan of its jump.
    """
    a, chosen = checked(arguments["backend"], *(arguments[name] for name in SCAN_INPUTS))
    states_at, out_at, state_patch, return_final_state = asked
    batch, channels, length = a.u.shape
    public, device = OP.public, a.u.device
    read = None if states_at is None else check_positions(public, states_at, batch, length, device)
    one = None if out_at is None else one_per_row(public, "out_at", out_at, batch, length, device)
    if state_patch is None:
        return _unpatched(a, chosen, read, one, return_final_state)
    shape = (batch, channels, a.A.shape[1])
    positions, values = check_state_patch(public, state_patch, shape, length, device)
    if not needs_grad((*a, values)):  # one pass that patches as it goes
        out, last, states = OP.implementation("torch").forward_patched(
            a, positions, values, read, one
        )
        return ScanAt(out, last if return_final_state else None, states)
    run = functools.partial(_unpatched, a, chosen)
    jump = functools.partial(_jump, a, chosen)
    return patch_by_jump(run, jump, positions, values, read, one, return_final_state, length, 2)


def _unpatched(a: ScanArgs, backend: str, read, one, return_final_state: bool) -> ScanAt:
    """The scan at positions `read` (B, P) and `one` (B,) (each None when not asked for)."""
    rows = torch.arange(a.u.shape[0], device=a.u.device)
    if read is not None and needs_grad(a):
        out, last, states = _states_by_steps(a, backend)
        states = states[rows[:, None], read]
        if one is not None:
            out = out[rows, :, one][..., None]
    elif read is not None:
        out, last, states = OP.implementation("torch").forward_states_at(a, read, one)
    elif one is not None and backend == "torch" and OP.runs_plain(a):
        (out, last), states = OP.implementation("torch").forward_out_at(a, one), None
    else:
        out, last, _ = OP(a._replace(save_checkpoints=needs_grad(a)), backend)
        states = None
        if one is not None:
            out = out[rows, :, one][..., None]
    return ScanAt(out, last if return_final_state else None, states)


def _jump(a: ScanArgs, backend: str, start, after, read, one, return_final_state) -> ScanAt:
    """The scan with no inputs (u = 0, so no skip either) from state `start`, holding still
    (dt = 0) wherever `after` is False; the gate still applies to its outputs."""
    dt = a.delta.float() if a.delta.dtype != torch.float64 else a.delta
    if a.delta_bias is not None:
        dt = dt + a.delta_bias.to(dt.dtype)[:, None]
    if a.softplus:
        dt = F.softplus(dt)
    jumped = a._replace(
        u=torch.zeros_like(a.u),
        delta=dt * after[:, None, :],
        D=None,
        delta_bias=None,
        softplus=False,
        initial_state=start,
    )
    return _unpatched(jumped, backend, read, one, return_final_state)


def _states_by_steps(a: ScanArgs, backend: str) -> tuple:
    """(out, last_state, states (B, L, D, N)) with gradients: one scan call per position, each
    from the state the previous one left."""
    outs, states, state = [], [], a.initial_state
    for t in range(a.u.shape[-1]):
        at = lambda x: x if x is None or x.dim() == 2 else x[..., t : t + 1]  # noqa: B023, E731
        out, state = selective_scan_fn(
            *(at(x) for x in (a.u, a.delta, a.A, a.B, a.C)),
            a.D,
            at(a.z),
            a.delta_bias,
            a.softplus,
            True,
            state,
            backend=backend,
        )
        outs.append(out)
        states.append(state)
    return torch.cat(outs, dim=-1), state, torch.stack(states, dim=1)
