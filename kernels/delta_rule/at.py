"""`at_positions_of_delta_rule`: the scan at positions of either op of the delta-rule family, the
delta rule or the gated delta rule (states after steps, the output at one step per row, a patched
state; mecheval_kernels.at_positions says what each means), and `scan_at`, the same on validated
arguments."""

from __future__ import annotations

import functools

import torch

from mecheval_kernels._op import Op, needs_grad
from mecheval_kernels.delta_rule.op import DeltaArgs, checked, kernel_for
from mecheval_kernels.scan_at import Asked, ScanAt, patch_by_jump
from mecheval_kernels.validation import check_positions, check_state_patch, one_per_row


def at_positions_of_delta_rule(op: Op, arguments: dict, asked: Asked) -> ScanAt:
    """The scan at positions of `op`, `chunk_delta_rule`'s or `chunk_gated_delta_rule`'s (see
    mecheval_kernels.at_positions).

    Args:
        op: the op of the family (mecheval_kernels.delta_rule.op.OP,
            mecheval_kernels.gated_delta_rule.op.OP).
        arguments: the op's public function's arguments by name (q, k, v, g for the gated
            delta rule, beta, scale, initial_state, use_qk_l2norm_in_kernel, backend).
        asked: what to return beside the output; the state is (B, H, K, V) float32 (float64
            for float64 inputs) (`states` (B, P, H, K, V), patch values (B, H, K, V)), `out`
            at `out_at` (B, 1, H, V).

    Without gradients, states come from the PyTorch path in one pass (on any device), and the
    PyTorch path forms the output at `out_at` alone (the state still runs through every step);
    with gradients, states come from one call per step (slow, exact). A patch is the unpatched
    scan plus the scan of its jump.
    """
    q, k, v, beta = (arguments[name] for name in ("q", "k", "v", "beta"))
    a, chosen = checked(
        op, arguments["backend"], q, k, v, arguments.get("g"), beta, arguments["scale"],
        arguments["initial_state"], asked.return_final_state,
        arguments["use_qk_l2norm_in_kernel"],
    )  # fmt: skip
    return scan_at(op, a, chosen, asked.states_at, asked.out_at, asked.state_patch)


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
    if a.g is not None:
        fields["g"] = a.g * mask
    return _unpatched(op, a._replace(**fields), backend, read, one, final)


def _states_by_steps(op: Op, a: DeltaArgs, backend: str) -> tuple:
    """(o, final, states (B, T, H, K, V)) with gradients: one call per step, each from the
    state the previous one left (a's inputs are validated and q, k already normalised)."""
    outs, states, state = [], [], a.initial_state
    kernel = kernel_for(backend, 1, gated=a.g is not None)
    timed = {f: getattr(a, f) for f in ("q", "k", "v", "g", "beta") if getattr(a, f) is not None}
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
