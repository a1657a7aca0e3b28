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
    p = pre.prepare(x, asked.return_final_state)
    B, L = x.V.shape[:2]
    public, device = f"mamba3_{'siso_combined' if kind == 'siso' else 'mimo'}", x.V.device
    read = asked.states_at
    read = None if read is None else check_positions(public, read, B, L, device)
    one = asked.out_at
    one = None if one is None else one_per_row(public, "out_at", one, B, L, device)
    shift = functools.partial(_shift, p)  # h -> h' at the given steps
    patch = asked.state_patch
    if patch is not None:
        H, P, N = x.V.shape[2], x.V.shape[3], x.Q.shape[-1]
        positions, values = check_state_patch(public, patch, (B, H, P, N), L, device)
        patch = (positions, values.to(p.core.q.dtype) + shift(positions[:, None])[:, 0])
    core = _core_at(p.core, backend, read, one, patch)
    states = None if read is None else core.states - shift(read)
    if one is None:
        y = core.out - pre.correction(p.q, p.k, p.v, p.c_next)
        out = pre.output(x, y, p.v, x.Z)
    else:
        at = lambda t: None if t is None else t[torch.arange(B, device=device), one][:, None]  # noqa: E731
        y = core.out - pre.correction(at(p.q), at(p.k), at(p.v), at(p.c_next))
        out = pre.output(x, y, at(p.v), at(x.Z))
    return ScanAt(out, core.final_state, states)


def _shift(p: pre.Prepared, at: torch.Tensor) -> torch.Tensor:
    """c_{t+1} W_t at steps at (B, P') of each row: (B, P', H, P, N)."""
    rows = torch.arange(at.shape[0], device=at.device)[:, None]
    pick = lambda t: t[rows, at]  # noqa: E731
    return pre.state_correction(pick(p.k), pick(p.v), pick(p.c_next))


def _core_at(a: CoreArgs, backend: str, read, one, patch) -> ScanAt:
    """The core's scan at steps `read` (B, P') and `one` (B,), with `patch` (positions, values
    of its state) or None."""
    run = functools.partial(_unpatched, a, backend)
    if patch is None:
        return run(read, one, a.output_final_state)
    jump = functools.partial(_jump, a, backend)
    return patch_by_jump(
        run, jump, *patch, read, one, a.output_final_state, a.q.shape[1], time_dim=1
    )


def _unpatched(a: CoreArgs, backend: str, read, one, final: bool) -> ScanAt:
    """The core at steps `read` and `one` (each None when not asked for)."""
    a = a._replace(output_final_state=final)
    rows = torch.arange(a.q.shape[0], device=a.q.device)
    states = None
    if read is not None and needs_grad(a):
        y, last, states = _states_by_steps(a, backend)
        states = states[rows[:, None], read]
    elif read is not None:
        y, last, states = CORE.implementation("torch").forward_states_at(a, read)
    else:
        y, last = run_core(a, backend)
    if one is not None:
        y = y[rows, one][:, None]
    return ScanAt(y, last if final else None, states)


def _jump(a: CoreArgs, backend: str, start, after, read, one, final) -> ScanAt:
    """The core with no writes (v = 0) from state `start`, holding still (a = 0) wherever
    `after` is False."""
    fields = dict(v=torch.zeros_like(a.v), a=a.a * after[..., None], initial_state=start)
    return _unpatched(a._replace(**fields), backend, read, one, final)


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
