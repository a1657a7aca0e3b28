"""`selective_scan_fn`: the public selective-scan op (validation and the call of its custom op;
the scaffold is kernels._op).

Both implementations' `forward` returns (out, last_state, checkpoints), where the checkpoints
(K, B, D, N) are the float32 states at the start of each chunk of positions, kept for the
backward (their number K depends on the implementation: `num_checkpoints`; K = 0 when no
gradient is needed).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels._op import Op, compute_dtype, needs_grad
from kernels.stacking import fold_into, unfold_from
from kernels.validation import (
    check_choice,
    check_positions,
    check_range,
    check_tensor,
    check_tensor_layouts,
    one_per_row,
)

MAX_STATE = 256
BC_LAYOUTS = ("D N", "B N L", "B G N L")


class ScanArgs(NamedTuple):
    """The custom op's inputs; `save_checkpoints`: keep the chunks' start states for a
    backward."""

    u: torch.Tensor
    delta: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    delta_bias: torch.Tensor | None
    initial_state: torch.Tensor | None
    softplus: bool
    save_checkpoints: bool


def _validate(dtypes, u, delta, A, B, C, D, z, delta_bias, initial_state, softplus) -> None:
    op = OP.public
    sizes: dict[str, int] = {}
    check_tensor(op, "u", u, "B D L", sizes, dtypes)
    for dim, what in (("L", "position (L"), ("B", "sequence (batch B"), ("D", "channel (D")):
        if sizes[dim] < 1:
            raise ValueError(f"{op}: u must have at least one {what} >= 1), got {dim} = 0")
    check_tensor(op, "delta", delta, "B D L", sizes, dtypes)
    check_tensor(op, "A", A, "D N", sizes, dtypes)
    check_range(op, "state size N (A.shape[1])", sizes["N"], 1, MAX_STATE)
    for name, X in (("B", B), ("C", C)):
        # Each of B and C has its own number of groups G.
        own = {k: v for k, v in sizes.items() if k != "G"}
        check_tensor_layouts(op, name, X, BC_LAYOUTS, own, dtypes)
        groups = own.get("G", 1)
        if groups < 1 or sizes["D"] % groups:
            raise ValueError(
                f"{op}: the number of groups of {name} (G = {groups}, {name} of shape "
                f"(B, G, N, L) = {tuple(X.shape)}) must divide the channels D = {sizes['D']}"
            )
    for name, t, dims in (
        ("D", D, "D"),
        ("z", z, "B D L"),
        ("delta_bias", delta_bias, "D"),
        ("initial_state", initial_state, "B D N"),
    ):
        if t is not None:
            check_tensor(op, name, t, dims, sizes, dtypes)
    check_choice(op, "delta_softplus", softplus, (False, True))


def _fake(a: ScanArgs, backend: str) -> tuple:
    batch, channels, length = a.u.shape
    N = a.A.shape[1]
    count = OP.implementation(backend).num_checkpoints(batch, channels, N, length)
    dtype = compute_dtype(a.u)
    return (
        torch.empty_like(a.u),
        a.u.new_empty(batch, channels, N, dtype=dtype),
        a.u.new_empty(count if a.save_checkpoints else 0, batch, channels, N, dtype=dtype),
    )


def _fold_bc(t: torch.Tensor, dim: int | None, m: int) -> torch.Tensor:
    """B or C of stacked models: (D, N) folds like A; one (B, N, L) per model becomes a group
    of channels per model; (B, G, N, L) gets M x G groups; a shared (B, N, L) stays shared."""
    logical = t.dim() - (dim is not None)
    if logical == 2:
        return fold_into(t, dim, m, 0)
    if logical == 3:
        return t if dim is None else t.movedim(dim, 1)  # (B, M, N, L): M groups
    return fold_into(t, dim, m, 1)


def _fold(a: ScanArgs, dims: ScanArgs, m: int):
    """Stacked models (kernels.stacking): the model axis folds into the channels."""
    channels = {f: 1 for f in ("u", "delta", "z", "initial_state")} | {
        f: 0 for f in ("A", "D", "delta_bias")
    }
    folded = a._replace(
        **{f: fold_into(getattr(a, f), getattr(dims, f), m, axis) for f, axis in channels.items()},
        B=_fold_bc(a.B, dims.B, m),
        C=_fold_bc(a.C, dims.C, m),
    )
    folded = folded._replace(save_checkpoints=needs_grad(folded))  # unseen through the vmap
    return folded, lambda i, t: unfold_from(t, m, 1) if i < 2 else (t, None)


OP = Op(
    __package__, "selective_scan_fn", ScanArgs, "B D L", _validate, _fake, 3, saved=1, fold=_fold
)


def selective_scan_fn(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    initial_state: torch.Tensor | None = None,
    *,
    states_at: torch.Tensor | None = None,
    out_at: torch.Tensor | None = None,
    state_patch: tuple[torch.Tensor, torch.Tensor] | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Mamba's selective scan, drop-in for mamba_ssm's `selective_scan_fn`.

        dt  = softplus(delta + delta_bias) if delta_softplus else delta + delta_bias
        h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t ;  y_t = sum_n h_t * C_t
        out = (y + D * u) * silu(z)

    Args:
        u: (B, D, L) float32/float16/bfloat16 (float64 on the PyTorch path); any strides.
        delta: (B, D, L), the step sizes before the optional bias and softplus.
        A: (D, N) real; N from 1 to 256. Mamba's A = -exp(A_log) is negative.
        B: (D, N) input-independent, (B, N, L) input-dependent, or (B, G, N, L) grouped, where
            channel d reads group d // (D // G) and G divides D.
        C: like B, independently of it.
        D: optional (D,) skip connection.
        z: optional (B, D, L) gate, applied as silu(z).
        delta_bias: optional (D,), added to delta before the softplus.
        delta_softplus: apply softplus to delta + delta_bias.
        return_last_state: also return the state after the last position.
        initial_state: optional (B, D, N), the state before position 0 (ours); gradients flow
            to it, and through the returned last state, so a scan split at any position and
            resumed from the carried state equals one scan.
        states_at: (ours) optional (B, P) integer positions: also return the state after
            positions states_at[b, :] of each row b, from the same one scan (every state:
            `torch.arange(L).expand(B, L)`), for reading or patching states at many positions.
            Without gradients it runs the PyTorch path, on any device (the Triton kernels keep
            the state on chip); when a gradient is needed, one call per position (slow, exact).
        out_at: (ours) optional (B,) integer positions: out is then (B, D, 1), the output at
            out_at[b] of each row b alone (a model's last layer, read out at the query); with
            `states_at` too, those states come along (from the PyTorch path, as `states_at`
            alone).
            Without gradients the PyTorch path forms only those outputs (every state still
            runs); otherwise the whole output is computed and picked.
        state_patch: (ours) optional (positions (B,), values (B, D, N)): the state after
            positions[b] of row b is replaced with values[b], and the scan goes on from it
            (the outputs after it, the last state and `states_at` from it on see the patch;
            the output at the position itself is the unpatched one). Without gradients
            only; it runs the PyTorch path, on any device.
        backend: "auto", "triton" or "torch"; None uses the process default (kernels.backend).

    Returns:
        out (B, D, L) in u's dtype and memory layout ((B, D, 1) with `out_at`), then
        last_state (B, D, N) float32 if `return_last_state`, then the states (B, P, D, N)
        float32 if `states_at` is given.
    """
    tensors = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)
    chosen = OP.check(backend, **tensors, initial_state=initial_state, softplus=delta_softplus)
    a = ScanArgs(
        **tensors,
        initial_state=initial_state,
        softplus=bool(delta_softplus),
        save_checkpoints=False,
    )
    if state_patch is not None:
        return _patched(a, state_patch, states_at, out_at, return_last_state)
    if out_at is not None:
        return _out_at(a, out_at, return_last_state, states_at, chosen)
    if states_at is not None:
        at = check_positions(OP.public, states_at, u.shape[0], u.shape[-1], u.device)
        if needs_grad(a):
            out, last_state, states = _states_by_steps(a, chosen)
            states = states[torch.arange(len(at), device=at.device)[:, None], at]
        else:
            out, last_state, states = OP.implementation("torch").forward_states_at(a, at)
        return (out, last_state, states) if return_last_state else (out, states)
    # The backward's checkpoints only when autograd will ask for a backward.
    out, last_state, _ = OP(a._replace(save_checkpoints=needs_grad(a)), chosen)
    if not return_last_state:
        return out
    return out, last_state


def _patched(a: ScanArgs, state_patch, states_at, out_at, return_last_state: bool) -> tuple:
    name = OP.public
    if needs_grad(a):
        raise ValueError(f"{name}: state_patch runs without gradients (torch.no_grad())")
    batch, channels, length = a.u.shape
    if not isinstance(state_patch, tuple) or len(state_patch) != 2:
        raise ValueError(f"{name}: state_patch must be a (positions, values) tuple")
    positions, values = state_patch
    at = one_per_row(name, "state_patch positions", positions, batch, length, a.u.device)
    expected = (batch, channels, a.A.shape[1])
    if not isinstance(values, torch.Tensor) or tuple(values.shape) != expected:
        raise ValueError(
            f"{name}: state_patch values must have shape {expected}, got "
            f"{tuple(getattr(values, 'shape', ()))}"
        )
    read = out_position = None
    if states_at is not None:
        read = check_positions(name, states_at, batch, length, a.u.device)
    if out_at is not None:
        out_position = one_per_row(name, "out_at", out_at, batch, length, a.u.device)
    torch_path = OP.implementation("torch")
    out, last_state, states = torch_path.forward_patched(a, at, values, read, out_position)
    outputs = [out] + [last_state] * return_last_state + ([states] if read is not None else [])
    return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _out_at(a: ScanArgs, out_at, return_last_state: bool, states_at, backend: str) -> tuple:
    batch = a.u.shape[0]
    at = one_per_row(OP.public, "out_at", out_at, batch, a.u.shape[-1], a.u.device)
    if states_at is not None:  # the outputs at `at` and the states at `read`
        read = check_positions(OP.public, states_at, batch, a.u.shape[-1], a.u.device)
        if needs_grad(a):
            out, last_state, states = _states_by_steps(a, backend)
            rows = torch.arange(batch, device=at.device)
            out, states = out[rows, :, at][..., None], states[rows[:, None], read]
        else:
            out, last_state, states = OP.implementation("torch").forward_states_at(a, read, at)
        return (out, last_state, states) if return_last_state else (out, states)
    if backend == "torch" and OP.runs_plain(a):
        out, last_state = OP.implementation("torch").forward_out_at(a, at)
    else:
        out, last_state, _ = OP(a._replace(save_checkpoints=needs_grad(a)), backend)
        out = out[torch.arange(batch, device=at.device), :, at][..., None]
    return (out, last_state) if return_last_state else out


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
