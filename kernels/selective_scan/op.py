"""`selective_scan_fn`: the public selective-scan op (validation and the call of its custom op;
the scaffold is mecheval_kernels._op).

Both implementations' `forward` returns (out, last_state, checkpoints), where the checkpoints
(K, B, D, N) are the float32 states at the start of each chunk of positions, kept for the
backward (their number K depends on the implementation: `num_checkpoints`; K = 0 when no
gradient is needed).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mecheval_kernels._op import Op, compute_dtype, needs_grad
from mecheval_kernels.selective_scan.reference import selective_scan_ref
from mecheval_kernels.stacking import fold_into, unfold_from
from mecheval_kernels.validation import (
    check_batch,
    check_choice,
    check_range,
    check_tensor,
    check_tensor_layouts,
    refuse_complex,
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
    refuse_complex(op, A=A, B=B, C=C)
    check_tensor(op, "u", u, "B D L", sizes, dtypes)
    check_batch(op, "u", sizes["B"])
    for dim, what in (("L", "position (L"), ("D", "channel (D")):
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
    check_tensor(op, "D", D, "D", sizes, dtypes, optional=True)
    check_tensor(op, "z", z, "B D L", sizes, dtypes, optional=True)
    check_tensor(op, "delta_bias", delta_bias, "D", sizes, dtypes, optional=True)
    check_tensor(op, "initial_state", initial_state, "B D N", sizes, dtypes, optional=True)
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
    """Stacked models (mecheval_kernels.stacking): the model axis folds into the channels."""
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


def _twice(a: ScanArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, last_state) recomputed by the per-position reference, for second derivatives."""
    return selective_scan_ref(
        a.u, a.delta, a.A, a.B, a.C, a.D, a.z, a.delta_bias, a.softplus, True, a.initial_state
    )


OP = Op(
    __package__, "selective_scan_fn", ScanArgs, "B D L", _validate, _fake, 3, saved=1,
    fold=_fold, twice=_twice,
)  # fmt: skip


def checked(backend, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state):
    """(the validated arguments as ScanArgs, the backend that runs them)."""
    tensors = dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias)
    chosen = OP.check(backend, **tensors, initial_state=initial_state, softplus=delta_softplus)
    a = ScanArgs(
        **tensors,
        initial_state=initial_state,
        softplus=bool(delta_softplus),
        save_checkpoints=False,
    )
    return a, chosen


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
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
        backend: "auto", "triton" or "torch"; None uses the process default
            (mecheval_kernels.backend).

    Returns:
        out (B, D, L) in u's dtype and memory layout, or (out, last_state (B, D, N) float32).
        States after given positions, the output at one position, a patched state:
        `mecheval_kernels.at_positions(mecheval_kernels.selective_scan_fn, ...)`.
    """
    a, chosen = checked(backend, u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state)
    # The backward's checkpoints only when autograd will ask for a backward.
    out, last_state, _ = OP(a._replace(save_checkpoints=needs_grad(a)), chosen)
    if not return_last_state:
        return out
    return out, last_state
