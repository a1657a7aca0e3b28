"""What the scans at positions share (mecheval_kernels.positions.at_positions says what they do):
`Asked`, what a call asks of one, `ScanAt`, the one named tuple each returns whatever is asked,
`reference_result`, what the mamba-ssm-style references return, and `patch_by_jump`, a state
patched inside a scan as the unpatched scan plus the scan of the jump.

A patch is exact for every scan because each is affine in its state: the patched scan is the
unpatched one plus the scan, with no inputs, of the jump (values - the state there) from the
position on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class Asked(NamedTuple):
    """What a call asks of a scan at positions beyond its output (see mecheval_kernels.positions).

    Attributes:
        states_at: (B, P) integer positions whose states to return, or None.
        out_at: (B,) the one position per row whose output to return, or None (every one).
        state_patch: (positions (B,), values (B, *state)), the state to replace, or None.
        return_final_state: return the state after the last position.
    """

    states_at: torch.Tensor | None = None
    out_at: torch.Tensor | None = None
    state_patch: tuple[torch.Tensor, torch.Tensor] | None = None
    return_final_state: bool = False


class ScanAt(NamedTuple):
    """What a scan at positions returns (see mecheval_kernels.positions).

    Attributes:
        out: the output, every position or (with `out_at`) one per row.
        final_state: the state after the last position, or None when not asked for.
        states: the states after `states_at`, (B, P, *state), or None when not asked for.
    """

    out: torch.Tensor
    final_state: torch.Tensor | None
    states: torch.Tensor | None


# run(states_at, out_at, return_final_state) -> ScanAt of the unpatched scan.
RunFn = Callable[[torch.Tensor | None, torch.Tensor | None, bool], ScanAt]
# jump(start, after, states_at, out_at, return_final_state) -> ScanAt of the scan with no
# inputs, starting from `start` (B, *state), that holds still wherever after (B, L) is False.
JumpFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, bool], ScanAt
]


def patch_by_jump(
    run: RunFn,
    jump: JumpFn,
    positions: torch.Tensor,
    values: torch.Tensor,
    states_at: torch.Tensor | None,
    out_at: torch.Tensor | None,
    return_final_state: bool,
    length: int,
    time_dim: int,
) -> ScanAt:
    """The scan with the state after positions[b] replaced with values[b]: the unpatched scan
    (which also returns the states there) plus the jump's scan from each row's position on.

    Args:
        run, jump: the op's unpatched scan and its scan of a jump (see RunFn, JumpFn).
        positions: (B,) int64; values: (B, *state).
        states_at, out_at, return_final_state: as the scans at positions take them.
        length: the sequence length L; time_dim: the time axis of the op's output.
    """
    first = positions[:, None]
    at = first if states_at is None else torch.cat([first, states_at], dim=1)
    base = run(at, out_at, return_final_state)
    here = base.states[:, 0]
    after = torch.arange(length, device=positions.device)[None, :] > first  # (B, L)
    delta = jump(values.to(here.dtype) - here, after, states_at, out_at, return_final_state)
    # The outputs after each row's position see the patch (with out_at: the one it holds).
    changed = after if out_at is None else (out_at > positions)[:, None]
    shape = [1] * base.out.dim()
    shape[0], shape[time_dim] = changed.shape
    out = base.out + changed.view(shape).to(base.out.dtype) * delta.out.to(base.out.dtype)
    final = None
    if return_final_state:
        final = base.final_state + delta.final_state.to(base.final_state.dtype)
    states = None
    if states_at is not None:  # from the patched position on, the states carry the jump
        reached = (states_at >= first).view(*states_at.shape, *(1,) * (here.dim() - 1))
        states = base.states[:, 1:] + reached.to(here.dtype) * delta.states
    return ScanAt(out, final, states)


def reference_result(
    out: torch.Tensor,
    last: torch.Tensor,
    states: list[torch.Tensor],
    return_last: bool,
    states_at: torch.Tensor | None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """A per-position reference scan's return, as mamba-ssm's references give it: out, then the
    last state when `return_last`, then with `states_at` (B, P) the states (one per position in
    `states`, batch first) after those positions; out alone when nothing else is asked."""
    result = (out,)
    if return_last:
        result += (last,)
    if states_at is not None:
        rows = torch.arange(out.shape[0], device=out.device)[:, None]
        result += (torch.stack(states, dim=1)[rows, states_at.to(out.device)],)
    return result[0] if len(result) == 1 else result
