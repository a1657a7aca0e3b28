"""`selective_scan_fn`: the public selective-scan op, its custom-op registration and autograd.

The op is registered with torch.library so that `torch.compile(fullgraph=True)` treats it as one
opaque node with a registered backward; which implementation runs is decided per call by
`kernels.backend` and passed to the custom op as a string. Both implementations share one
interface: `forward` returns (out, last_state, checkpoints), where the checkpoints (K, B, D, N)
are the float32 states at the start of each chunk of positions, saved for the backward (their
number K depends on the implementation: `num_checkpoints`; K = 0 when no gradient is needed).
"""

from __future__ import annotations

import torch

from kernels.backend import resolve_backend
from kernels.selective_scan import torch_path
from kernels.validation import (
    allowed_dtypes,
    check_choice,
    check_range,
    check_same_device,
    check_tensor,
    check_tensor_layouts,
)

OP = "selective_scan_fn"
MAX_STATE = 256
BC_LAYOUTS = ("D N", "B N L", "B G N L")


def _impl(backend: str):
    if backend == "triton":
        from kernels.selective_scan import triton_kernels

        return triton_kernels
    return torch_path


def _state_dtype(u: torch.Tensor) -> torch.dtype:
    return torch.float64 if u.dtype == torch.float64 else torch.float32


@torch.library.custom_op("mecheval::selective_scan_fwd", mutates_args=())
def _scan_fwd(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    softplus: bool,
    save_checkpoints: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out, last_state, checkpoints = _impl(backend).forward(
        u, delta, A, B, C, D, z, delta_bias, initial_state, softplus, save_checkpoints
    )
    return out, last_state, checkpoints


@_scan_fwd.register_fake
def _(u, delta, A, B, C, D, z, delta_bias, initial_state, softplus, save, backend):
    batch, channels, length = u.shape
    N = A.shape[1]
    n_ckpt = _impl(backend).num_checkpoints(batch, channels, N, length) if save else 0
    dtype = _state_dtype(u)
    return (
        torch.empty_like(u),
        u.new_empty(batch, channels, N, dtype=dtype),
        u.new_empty(n_ckpt, batch, channels, N, dtype=dtype),
    )


@torch.library.custom_op("mecheval::selective_scan_bwd", mutates_args=())
def _scan_bwd(
    dout: torch.Tensor,
    dlast: torch.Tensor | None,
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    delta_bias: torch.Tensor | None,
    initial_state: torch.Tensor | None,
    checkpoints: torch.Tensor,
    softplus: bool,
    backend: str,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    grads = _impl(backend).backward(
        dout, dlast, u, delta, A, B, C, D, z, delta_bias, initial_state, checkpoints, softplus
    )
    # Custom ops return tensors only: absent inputs get distinct empty placeholders (outputs
    # may not alias), which the autograd glue drops.
    return tuple(u.new_empty(0) if g is None else g for g in grads)


@_scan_bwd.register_fake
def _(dout, dlast, u, delta, A, B, C, D, z, delta_bias, initial_state, checkpoints, sp, be):
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    return tuple(u.new_empty(0) if t is None else torch.empty_like(t) for t in inputs)


def _setup_context(ctx, inputs, output):
    u, delta, A, B, C, D, z, delta_bias, initial_state, softplus, _, backend = inputs
    checkpoints = output[2]
    ctx.mark_non_differentiable(checkpoints)
    ctx.save_for_backward(u, delta, A, B, C, D, z, delta_bias, initial_state, checkpoints)
    ctx.softplus, ctx.backend = softplus, backend


def _backward(ctx, dout, dlast, dcheckpoints):
    u, delta, A, B, C, D, z, delta_bias, initial_state, checkpoints = ctx.saved_tensors
    grads = _scan_bwd(
        dout,
        dlast,
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        initial_state,
        checkpoints,
        ctx.softplus,
        ctx.backend,
    )
    inputs = (u, delta, A, B, C, D, z, delta_bias, initial_state)
    return (
        *(None if t is None else g for t, g in zip(inputs, grads, strict=True)),
        None,
        None,
        None,
    )


_scan_fwd.register_autograd(_backward, setup_context=_setup_context)


def _validate(u, delta, A, B, C, D, z, delta_bias, initial_state, softplus, backend: str) -> None:
    dtypes = allowed_dtypes(backend)
    sizes: dict[str, int] = {}
    check_tensor(OP, "u", u, "B D L", sizes, dtypes)
    if sizes["L"] < 1:
        raise ValueError(f"{OP}: u must have at least one position (L >= 1), got L = 0")
    if sizes["B"] < 1:
        raise ValueError(f"{OP}: u must have at least one sequence (batch B >= 1), got B = 0")
    if sizes["D"] < 1:
        raise ValueError(f"{OP}: u must have at least one channel (D >= 1), got D = 0")
    check_tensor(OP, "delta", delta, "B D L", sizes, dtypes)
    check_tensor(OP, "A", A, "D N", sizes, dtypes)
    check_range(OP, "state size N (A.shape[1])", sizes["N"], 1, MAX_STATE)
    for name, X in (("B", B), ("C", C)):
        # Each of B and C has its own number of groups G.
        own = {k: v for k, v in sizes.items() if k != "G"}
        check_tensor_layouts(OP, name, X, BC_LAYOUTS, own, dtypes)
        groups = own.get("G", 1)
        if groups < 1 or sizes["D"] % groups:
            raise ValueError(
                f"{OP}: the number of groups of {name} (G = {groups}, {name} of shape "
                f"(B, G, N, L) = {tuple(X.shape)}) must divide the channels D = {sizes['D']}"
            )
    if D is not None:
        check_tensor(OP, "D", D, "D", sizes, dtypes)
    if z is not None:
        check_tensor(OP, "z", z, "B D L", sizes, dtypes)
    if delta_bias is not None:
        check_tensor(OP, "delta_bias", delta_bias, "D", sizes, dtypes)
    if initial_state is not None:
        check_tensor(OP, "initial_state", initial_state, "B D N", sizes, dtypes)
    check_choice(OP, "delta_softplus", softplus, (False, True))


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
        backend: "auto", "triton" or "torch"; None uses the process default (kernels.backend).

    Returns:
        out (B, D, L) in u's dtype and memory layout, or (out, last_state (B, D, N) float32).
    """
    check_tensor(OP, "u", u, "B D L", {})
    tensors = dict(
        u=u,
        delta=delta,
        A=A,
        B=B,
        C=C,
        D=D,
        z=z,
        delta_bias=delta_bias,
        initial_state=initial_state,
    )
    device = check_same_device(
        OP, **{k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    )
    chosen = resolve_backend(OP, backend, device)
    _validate(u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus, chosen)
    # The backward's checkpoints only when autograd will ask for a backward.
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors.values()
    )
    out, last_state, _ = _scan_fwd(
        u,
        delta,
        A,
        B,
        C,
        D,
        z,
        delta_bias,
        initial_state,
        bool(delta_softplus),
        needs_grad,
        chosen,
    )
    if not return_last_state:
        return out
    return out, last_state
