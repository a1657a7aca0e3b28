"""`at_positions_of_dplr`: the scan at positions of `chunk_dplr_delta_rule` and of
`chunk_rwkv7` (states after steps, the output at one step per row, a patched state;
mecheval_kernels.at_positions says what each means), and `scan_at`, the same on validated
arguments."""

from __future__ import annotations

import functools

import torch

from mecheval_kernels._op import Op, needs_grad
from mecheval_kernels.dplr.op import DplrArgs, check_hints, checked, refuse_packed
from mecheval_kernels.scan_at import ScanAt, patch_by_jump
from mecheval_kernels.validation import check_positions, check_state_patch, one_per_row


def scan_at(op: Op, a: DplrArgs, backend: str, states_at, out_at, state_patch) -> ScanAt:
    """The scan at positions of `op` (the DPLR delta rule's or RWKV-7's) on its validated
    arguments `a` (`a.output_final_state` says whether the final state is wanted); the state is
    (B, H, K, V) float32 (float64 for float64 inputs).

    Without gradients, states come from the PyTorch path in one pass (on any device), and the
    PyTorch path forms the output at `out_at` alone (the state still runs through every step);
    with gradients, states come from one call per step (slow, exact). A patch is the unpatched
    scan plus the scan of its jump (mecheval_kernels.scan_at.patch_by_jump).
    """
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


def _unpatched(op: Op, a: DplrArgs, backend: str, read, one, final: bool) -> ScanAt:
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
    elif backend == "torch" and op.runs_plain(a):  # no backward: nothing kept for it
        if one is not None:
            (o, last), one = torch_path.forward_out_at(a, one), None
        else:
            o, last = torch_path.forward_inference(a)
    else:
        o, last, _ = op(a, backend)
    if one is not None:
        o = o[rows, one][:, None]
    return ScanAt(o, last if final else None, states)


def _jump(op: Op, a: DplrArgs, backend: str, start, after, read, one, final) -> ScanAt:
    """The scan with no values (v = 0) from state `start`, holding still wherever `after` is
    False: no decay (gk = 0) and no low-rank term (b = 0) there."""
    mask = after[..., None, None]  # (B, T, 1, 1) over heads and channels
    fields = dict(v=torch.zeros_like(a.v), b=a.b * mask, gk=a.gk * mask, initial_state=start)
    return _unpatched(op, a._replace(**fields), backend, read, one, final)


def _states_by_steps(op: Op, a: DplrArgs, backend: str) -> tuple:
    """(o, final, states (B, T, H, K, V)) with gradients: one call per step, each from the
    state the previous one left."""
    outs, states, state = [], [], a.initial_state
    timed = ("q", "k", "v", "a", "b", "gk")
    for t in range(a.q.shape[1]):
        step = a._replace(
            **{f: getattr(a, f)[:, t : t + 1] for f in timed},
            initial_state=state,
            output_final_state=True,
        )
        o, state, _ = op(step, backend)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=1), state, torch.stack(states, dim=1)


def at_positions_of_dplr(op: Op, names: dict, arguments: dict, asked) -> ScanAt:
    """The scan at positions of `op` on its public function's arguments by name (`names`: the
    public names of fla's dplr arguments q and gk, RWKV-7's r and w); see
    mecheval_kernels.at_positions. Its kernel hints are checked as the op checks them."""
    public = op.public
    refuse_packed(
        public, arguments["cu_seqlens"], arguments["cu_seqlens_cpu"], arguments["cp_context"],
        arguments.get("kwargs", {}),
    )  # fmt: skip
    check_hints(
        public, arguments["safe_gate"], arguments["chunk_size"], arguments["disable_recompute"]
    )
    get = lambda name: arguments[names.get(name, name)]  # noqa: E731
    a, chosen = checked(
        op, arguments["backend"], get("q"), get("k"), get("v"), get("a"), get("b"), get("gk"),
        arguments["scale"], arguments["initial_state"], asked.return_final_state,
        arguments["lower_bound"], names,
    )  # fmt: skip
    return scan_at(op, a, chosen, asked.states_at, asked.out_at, asked.state_patch)
