"""What the scans at positions share (mecheval_kernels.positions.at_positions says what they do):
`Asked`, what a call asks of one, `ScanAt`, the one named tuple each returns whatever is asked,
`reference_result`, what the mamba-ssm-style references return, `patch_by_jump`, a state
patched inside a scan as the unpatched scan plus the scan of the jump, and `scan_at_by_jump`,
the whole scan at positions of an op whose arguments are one NamedTuple (the delta-rule family's
and the DPLR delta rule's).

A patch is exact for every scan because each is affine in its state: the patched scan is the
unpatched one plus the scan, with no inputs, of the jump (values - the state there) from the
position on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from mecheval_kernels._op import Op, needs_grad
from mecheval_kernels.validation import check_positions, check_state_patch, one_per_row


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


def scan_at_by_jump(
    op: Op,
    a: NamedTuple,
    backend: str,
    asked: Asked,
    held: Callable[[NamedTuple, torch.Tensor], dict],
    timed: tuple[str, ...],
    step: dict | None = None,
) -> ScanAt:
    """The scan at positions of `op` on its validated arguments `a` (a NamedTuple with q, v,
    initial_state and output_final_state; `a.output_final_state` says whether the final state
    is wanted; the state (B, H, K, V)). Without gradients, states come from the PyTorch path in
    one pass (on any device), and the PyTorch path forms the output at `out_at` alone (the state
    still runs through every step); with gradients, states come from one call per step (slow,
    exact). A patch is the unpatched scan plus the scan of its jump (`patch_by_jump`).

    Args:
        held: a's fields that make the jump's scan hold still where `after` (B, T) is False (no
            writes, no decay), beside v = 0 and the jump's start state.
        timed: a's (B, T, ...) fields, cut step by step for the states with gradients.
        step: fields replaced in each of those one-step calls (a kernel hint), or None.
    """
    batch, length, heads, K = a.q.shape
    public, device, step = op.public, a.q.device, step or {}
    read, one = asked.states_at, asked.out_at
    read = None if read is None else check_positions(public, read, batch, length, device)
    one = None if one is None else one_per_row(public, "out_at", one, batch, length, device)
    run = functools.partial(_unpatched, op, a, backend, timed, step)
    if asked.state_patch is None:
        return run(read, one, a.output_final_state)
    shape = (batch, heads, K, a.v.shape[-1])
    positions, values = check_state_patch(public, asked.state_patch, shape, length, device)

    def jump(start, after, read, one, final) -> ScanAt:
        fields = dict(held(a, after), v=torch.zeros_like(a.v), initial_state=start)
        return _unpatched(op, a._replace(**fields), backend, timed, step, read, one, final)

    return patch_by_jump(
        run, jump, positions, values, read, one, a.output_final_state, length, time_dim=1
    )


def _unpatched(op: Op, a, backend: str, timed, step, read, one, final: bool) -> ScanAt:
    """The scan at steps `read` (B, P) and `one` (B,) (each None when not asked for)."""
    a = a._replace(output_final_state=final)
    torch_path = op.implementation("torch")
    rows = torch.arange(a.q.shape[0], device=a.q.device)
    states = None
    if read is not None and needs_grad(a):
        o, last, states = _states_by_steps(op, a, backend, timed, step)
        states = states[rows[:, None], read]
    elif read is not None:
        o, last, states = torch_path.forward_states_at(a, read)
    elif backend == "torch" and op.runs_plain(a):  # no backward: no saved buffers
        if one is not None:
            (o, last), one = torch_path.forward_out_at(a, one), None
        else:
            o, last = torch_path.forward_inference(a)
    else:
        o, last, *_ = op(a, backend)
    if one is not None:
        o = o[rows, one][:, None]
    return ScanAt(o, last if final else None, states)


def _states_by_steps(op: Op, a, backend: str, timed, step) -> tuple:
    """(o, final, states (B, T, H, K, V)) with gradients: one call per step, each from the
    state the previous one left."""
    outs, states, state = [], [], a.initial_state
    cut = {f: getattr(a, f) for f in timed if getattr(a, f) is not None}
    for t in range(a.q.shape[1]):
        one_step = a._replace(
            **{f: x[:, t : t + 1] for f, x in cut.items()},
            **step,
            initial_state=state,
            output_final_state=True,
        )
        o, state, *_ = op(one_step, backend)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=1), state, torch.stack(states, dim=1)


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
