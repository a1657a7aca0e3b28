"""The recurrent scans at positions: what an intervention engine needs from a scan beyond its
drop-in function, from one call that returns `ScanAt` whatever is asked.

    selective_scan_at(u, delta, A, B, C, ...)           Mamba's selective scan
    mamba2_scan_at(x, dt, A, B, C, ...)                 Mamba-2's scan
    chunk_delta_rule_at(q, k, v, beta, ...)             the delta rule
    chunk_gated_delta_rule_at(q, k, v, g, beta, ...)    the gated delta rule

Each takes its op's inputs as the drop-in names them and, keyword-only:

    states_at           (B, P) integer positions: `states` holds the states after positions
                        states_at[b, :] of each row b, (B, P, *state)
    out_at              (B,) one position per row: `out` is the output there alone (its time
                        axis of length 1)
    state_patch         (positions (B,), values (B, *state)): the state after positions[b] of
                        row b is replaced with values[b] and the scan goes on from it: the
                        outputs after the position, the final state and the states at or after
                        it see the patch; the output at the position itself does not
    return_final_state  return the state after the last position (else None, and a scan may
                        skip forming it)
    backend             as the drop-in's

Gradients flow to every tensor input and to the patch values. A patch is exact for every
scan because each is affine in its state: the patched scan is the unpatched one plus the scan,
with no inputs, of the jump (values - the state there) from the position on (`patch_by_jump`).
Without gradients, on the PyTorch path, the selective scan patches inside its one pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class ScanAt(NamedTuple):
    """What a scan at positions returns (see the module docstring).

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
