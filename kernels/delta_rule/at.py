"""`at_positions_of_delta_rule`: the scan at positions of an op of the delta-rule family (the
delta rule, the gated delta rule, KDA, Comba; states after steps, the output at one step per row,
a patched state; mecheval_kernels.at_positions says what each means), and `scan_at`, the same on
validated arguments."""

from __future__ import annotations

import functools

import torch

from mecheval_kernels._op import Op, needs_grad
from mecheval_kernels.delta_rule import dropin
from mecheval_kernels.delta_rule.op import DeltaArgs, Variant, kernel_for, prepare
from mecheval_kernels.scan_at import Asked, ScanAt, patch_by_jump
from mecheval_kernels.validation import check_positions, check_state_patch, one_per_row


def at_positions_of_delta_rule(variant: Variant, arguments: dict, asked: Asked) -> ScanAt:
    """The scan at positions of `variant`'s op (see mecheval_kernels.at_positions).

    Args:
        variant: the op of the family (mecheval_kernels.delta_rule.op.DELTA_RULE, ...).
        arguments: the op's public function's arguments by name, as it takes them.
        asked: what to return beside the output; the state is (B, HV, K, V) float32 (float64
            for float64 inputs), (B, HV, V, K) with state_v_first (`states` (B, P, *state),
            patch values (B, *state)), `out` at `out_at` (B, 1, HV, V).

    Without gradients, states come from the PyTorch path in one pass (on any device), and the
    PyTorch path forms the output at `out_at` alone (the state still runs through every step);
    with gradients, states come from one call per step (slow, exact). A patch is the unpatched
    scan plus the scan of its jump.
    """
    call = prepare(variant, arguments, asked.return_final_state)
    patch = asked.state_patch
    if isinstance(patch, tuple) and len(patch) == 2 and isinstance(patch[1], torch.Tensor):
        patch = (patch[0], dropin.state_in(patch[1], call.options))
    result = scan_at(variant.op, call.args, call.backend, asked.states_at, asked.out_at, patch)
    return result._replace(
        final_state=dropin.state_out(result.final_state, call.options),
        states=dropin.state_out(result.states, call.options),
    )


def scan_at(op: Op, a: DeltaArgs, backend: str, states_at, out_at, state_patch) -> ScanAt:
    """The scan at positions of an op of the family on its validated arguments `a` (q and k
    already normalised; `a.output_final_state` says whether the final state is wanted)."""
    batch, length, heads, K = a.q.shape
    public, device = op.public, a.q.device
    read = None if states_at is None else check_positions(public, states_at, batch, length, device)
    one = None if out_at is None else one_per_row(public, "out_at", out_at, batch, length, device)
    run = functools.partial(_unpatched, op, a, backend)
    if state_patch is None:
        return run(read, one, a.output_final_state)
    shape = (batch, heads, K, a.v.shape[-1])
    positions, values = check_state_patch(public, state_patch, shape, length, device)
    jump = functools.partial(_jump, op, a, backend)
    return patch_by_jump(
        run, jump, positions, values, read, one, a.output_final_state, length, time_dim=1
    )


def _unpatched(op: Op, a: DeltaArgs, backend: str, read, one, final: bool) -> ScanAt:
    """The scan at steps `read` (B, P) and `one` (B,) (each None when not asked for)."""
    a = a._replace(output_final_state=final)
    torch_path = op.implementation("torch")
    rows = torch.arange(a.q.shape[0], device=a.q.device)
    states = None
    if read is not None and needs_grad(a):
        o, last, states = _states_by_steps(op, a, backend)
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


def _jump(op: Op, a: DeltaArgs, backend: str, start, after, read, one, final) -> ScanAt:
    """The scan with no values (v = 0) from state `start`, holding still wherever `after` is
    False: no writes there (beta = 0) and, gated, no decay (g = 0)."""
    mask = after[..., None]  # (B, T, 1) over the heads
    fields = dict(v=torch.zeros_like(a.v), beta=a.beta * mask, initial_state=start)
    if a.g is not None:  # (B, T, H) or, a decay per key channel, (B, T, H, K)
        fields["g"] = a.g * (mask if a.g.dim() == 3 else mask[..., None])
    return _unpatched(op, a._replace(**fields), backend, read, one, final)


def _states_by_steps(op: Op, a: DeltaArgs, backend: str) -> tuple:
    """(o, final, states (B, T, H, K, V)) with gradients: one call per step, each from the
    state the previous one left (a's inputs are validated and q, k already normalised)."""
    outs, states, state = [], [], a.initial_state
    kernel = kernel_for(backend, 1, gated=a.g is not None or a.p is not None)
    fields = ("q", "k", "v", "p", "g", "beta")
    timed = {f: getattr(a, f) for f in fields if getattr(a, f) is not None}
    for t in range(a.q.shape[1]):
        step = a._replace(
            **{f: x[:, t : t + 1] for f, x in timed.items()},
            initial_state=state,
            output_final_state=True,
            kernel=kernel,
        )
        o, state, *_ = op(step, backend)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=1), state, torch.stack(states, dim=1)
