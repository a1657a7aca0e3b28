"""`at_positions_of_mamba3`: the scan at positions of `mamba3_siso_combined` and `mamba3_mimo`
(states after steps, the output at one step per row, a patched state;
mecheval_kernels.at_positions says what each means). The state is the SSM state h (B, H, P, N)
in float32 (float64 for float64 inputs); the rotation angles and the last k and v, the rest of
the peer's carried state, are not patched.

The core runs h'_t = h_t + c_{t+1} W_t (prepare.py), so: states are the core's minus c_{t+1} W_t
there; a patch of h after step p is a patch of the core's state with c_{p+1} W_p added; the
output at a step is the core's there minus its local correction, then the skip, gate and MIMO
contraction of that step alone.
"""

from __future__ import annotations

import functools

import torch

from mecheval_kernels._op import needs_grad
from mecheval_kernels.mamba3 import prepare as pre
from mecheval_kernels.mamba3.core import CORE, CoreArgs, run_core
from mecheval_kernels.mamba3.validation import check_mimo, check_siso
from mecheval_kernels.scan_at import ScanAt, patch_by_jump
from mecheval_kernels.validation import check_positions, check_state_patch, one_per_row

SISO = (
    "Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "Angles", "D", "Z", "Input_States",
    "chunk_size", "return_final_states", "cu_seqlens",
)  # fmt: skip
MIMO = (
    "Q", "K", "V", "ADT", "DT", "Trap", "Q_bias", "K_bias", "MIMO_V", "MIMO_Z", "MIMO_Out",
    "Angles", "D", "Z", "chunk_size", "rotary_dim_divisor", "dtype", "return_state",
    "cu_seqlens", "fuse_pregate_headwise_rms_norm", "outproj_norm_weight", "outproj_norm_eps",
    "Input_States",
)  # fmt: skip


def at_positions_of_mamba3(kind: str, arguments: dict, asked) -> ScanAt:
    """The scan at positions of the SISO ("siso") or MIMO ("mimo") drop-in, on its arguments by
    name (see mecheval_kernels.at_positions and the module docstring)."""
    check, names = (check_siso, SISO) if kind == "siso" else (check_mimo, MIMO)
    x, backend = check(arguments["backend"], *(arguments[n] for n in names))
    B, L = x.V.shape[:2]
    public, device = f"mamba3_{'siso_combined' if kind == 'siso' else 'mimo'}", x.V.device
    read = asked.states_at
    read = None if read is None else check_positions(public, read, B, L, device)
    one = asked.out_at
    one = None if one is None else one_per_row(public, "out_at", one, B, L, device)
    # The output at one step alone, without gradients: the queries there alone, read from the
    # states there (the core's outputs are not formed).
    alone = one is not None and CORE.runs_plain(_tensors(x))
    p = pre.prepare(x, asked.return_final_state, queries=not alone)
    q_one = pre.queries_at(x, p, one) if alone else None
    patch = asked.state_patch
    if patch is not None:
        H, P, N = x.V.shape[2], x.V.shape[3], x.Q.shape[-1]
        positions, values = check_state_patch(public, patch, (B, H, P, N), L, device)
        patch = (positions, values.to(p.core.k.dtype) + _shift(p, positions[:, None])[:, 0])
    core = _core_at(p.core, backend, read, one, patch, q_one)
    states = None if read is None else core.states - _shift(p, read)
    if one is None:
        y = core.out - pre.correction(p.q, p.k, p.v, p.c_next)
        return ScanAt(pre.output(x, y, p.v, x.Z), core.final_state, states)
    at = lambda t: None if t is None else t[torch.arange(B, device=device), one][:, None]  # noqa: E731
    q = q_one if alone else at(p.q)
    y = core.out - pre.correction(q, at(p.k), at(p.v), at(p.c_next))
    return ScanAt(pre.output(x, y, at(p.v), at(x.Z)), core.final_state, states)


def _tensors(x: pre.Inputs) -> tuple:
    """Every tensor of a call (the input states' included)."""
    states = x.states or ()
    return tuple(t for t in (*x, *states) if isinstance(t, torch.Tensor))


def _shift(p: pre.Prepared, at: torch.Tensor) -> torch.Tensor:
    """c_{t+1} W_t at steps at (B, P') of each row: (B, P', H, P, N)."""
    rows = torch.arange(at.shape[0], device=at.device)[:, None]
    pick = lambda t: t[rows, at]  # noqa: E731
    return pre.state_correction(pick(p.k), pick(p.v), pick(p.c_next))


def _core_at(a: CoreArgs, backend: str, read, one, patch, q_one) -> ScanAt:
    """The core's scan at steps `read` (B, P') and `one` (B,), with `patch` (positions, values
    of its state) or None; `q_one` (B, 1, R, H, N): the queries at `one` alone (no gradients;
    a.q is then None)."""
    run = functools.partial(_unpatched, a, backend, q_one=q_one)
    if patch is None:
        return run(read, one, a.output_final_state)
    jump = functools.partial(_jump, a, backend, q_one=q_one)  # closed form: no writes
    return patch_by_jump(
        run, jump, *patch, read, one, a.output_final_state, a.k.shape[1], time_dim=1
    )


def _unpatched(a: CoreArgs, backend: str, read, one, final: bool, q_one=None) -> ScanAt:
    """The core at steps `read` and `one` (each None when not asked for)."""
    a = a._replace(output_final_state=final)
    rows = torch.arange(a.k.shape[0], device=a.k.device)
    torch_path = CORE.implementation("torch")
    if q_one is not None:  # the states at `one` read out with its queries
        at = one[:, None] if read is None else torch.cat([read, one[:, None]], dim=1)
        _, last, states = torch_path.forward_states_at(a, at, outputs=False)
        y = torch.einsum("bhpn,blrhn->blrhp", states[:, -1], q_one)
        return ScanAt(y, last if final else None, None if read is None else states[:, :-1])
    states = None
    if read is not None and needs_grad(a):
        y, last, states = _states_by_steps(a, backend)
        states = states[rows[:, None], read]
    elif read is not None:
        y, last, states = torch_path.forward_states_at(a, read)
    else:
        y, last = run_core(a, backend)
    if one is not None:
        y = y[rows, one][:, None]
    return ScanAt(y, last if final else None, states)


def _jump(a: CoreArgs, backend: str, start, after, read, one, final, q_one=None) -> ScanAt:
    """The core with no writes from state `start`, holding still wherever `after` (B, L) is
    False: the state after step t is exp(the sum of a over the steps after the hold, up to t)
    times `start` (summed from zero: no cancellation), read out with q; in closed form, on any
    backend, gradients included."""
    decay = (a.a * after[..., None]).cumsum(1).exp()  # (B, L, H)
    rows = torch.arange(a.k.shape[0], device=a.k.device)
    scaled = lambda d: d[..., None, None] * start[:, None]  # (B, L', H, P, N)  # noqa: E731
    states = None if read is None else scaled(decay[rows[:, None], read])
    if one is not None:
        q = q_one if q_one is not None else a.q[rows, one][:, None]
        y = torch.einsum("blhpn,blrhn->blrhp", scaled(decay[rows, one][:, None]), q)
    else:
        y = torch.einsum("bhpn,blrhn->blrhp", start, a.q) * decay[:, :, None, :, None]
    return ScanAt(y, scaled(decay[:, -1:])[:, 0] if final else None, states)


def _states_by_steps(a: CoreArgs, backend: str) -> tuple:
    """(y, final, states (B, L, H, P, N)) with gradients: one call per step."""
    ys, states, state = [], [], a.initial_state
    for t in range(a.q.shape[1]):
        step = a._replace(
            **{f: getattr(a, f)[:, t : t + 1] for f in ("q", "k", "v", "a", "s")},
            initial_state=state,
            output_final_state=True,
        )
        y, state = run_core(step, backend)
        ys.append(y)
        states.append(state)
    return torch.cat(ys, dim=1), state, torch.stack(states, dim=1)
