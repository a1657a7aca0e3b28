"""`mamba2_scan`: Mamba-2's scan (SSD) with mamba-ssm's `mamba_chunk_scan_combined` layouts.

Two implementations, chosen by the backend (mecheval_kernels.backend):
  "torch"   the chunked SSD algorithm in PyTorch (mecheval_kernels.ssd.chunked), differentiated by
            autograd: runs under torch.vmap and torch.compile as plain PyTorch does.
  "triton"  Mamba-2 as a selective scan (`on_selective_scan`): the head's scalar A broadcast
            over its channels and state indices, dt broadcast from heads to channels, B and C
            as groups of channels; the selective scan's Triton kernels (and their backward,
            vmap rule and custom op) then run it.
The selective-scan form is also what runs the scan at positions (mecheval_kernels.ssd.at: states,
outputs at positions, patched states), on either backend. docs/kernels.md has the
measurements behind the choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mecheval_kernels.backend import resolve_backend
from mecheval_kernels.scan_at import Asked, ScanAt
from mecheval_kernels.selective_scan.at import at_positions_of_selective_scan
from mecheval_kernels.selective_scan.op import MAX_STATE
from mecheval_kernels.ssd.chunked import Inputs, ssd_chunked
from mecheval_kernels.validation import (
    allowed_dtypes,
    check_batch,
    check_choice,
    check_range,
    check_same_device,
    check_tensor,
    check_tensor_layouts,
    refuse_unsupported,
)

OP = "mamba2_scan"


def _validate(dtypes, x, dt, A, B, C, D, z, dt_bias, initial_states, softplus, chunk_size):
    sizes: dict[str, int] = {}
    check_tensor(OP, "x", x, "B L H P", sizes, dtypes)
    check_batch(OP, "x", sizes["B"])
    for dim, what in (("L", "length"), ("H", "heads"), ("P", "head dim")):
        if sizes[dim] < 1:
            raise ValueError(f"{OP}: x must have {what} {dim} >= 1, got shape {tuple(x.shape)}")
    check_tensor(OP, "dt", dt, "B L H", sizes, dtypes)
    check_tensor(OP, "A", A, "H", sizes, dtypes)
    check_tensor(OP, "B", B, "B L G N", sizes, dtypes)
    check_range(OP, "state size N (B.shape[3])", sizes["N"], 1, MAX_STATE)
    if sizes["G"] < 1 or sizes["H"] % sizes["G"]:
        raise ValueError(
            f"{OP}: the number of groups of B and C (G = {sizes['G']}, B of shape (B, L, G, N) "
            f"= {tuple(B.shape)}) must divide the heads H = {sizes['H']}"
        )
    check_tensor(OP, "C", C, "B L G N", sizes, dtypes)
    if D is not None:
        check_tensor_layouts(OP, "D", D, ("H", "H P"), sizes, dtypes)
    check_tensor(OP, "z", z, "B L H P", sizes, dtypes, optional=True)
    check_tensor(OP, "dt_bias", dt_bias, "H", sizes, dtypes, optional=True)
    check_tensor(OP, "initial_states", initial_states, "B H P N", sizes, dtypes, optional=True)
    check_choice(OP, "dt_softplus", softplus, (False, True))
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"{OP}: chunk_size must be None or an int >= 1, got {chunk_size!r}")


NO_LIMIT = (0.0, float("inf"))


def checked(backend, x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_states, chunk_size,
            dt_limit=NO_LIMIT) -> tuple[Inputs, str]:  # fmt: skip
    """(the validated inputs, the backend that runs them). The step sizes are clamped to
    dt_limit after the bias and softplus, the default (0, inf) included, as mamba-ssm's
    kernel always clamps: where the clamp can change them (a limit other than (0, inf), or no
    softplus to keep them >= 0) they are formed here and passed on as they are."""
    check_tensor(OP, "x", x, "B L H P", {})
    tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    device = check_same_device(OP, **tensors, initial_states=initial_states)
    chosen = resolve_backend(OP, backend, device)
    _validate(
        allowed_dtypes(chosen),
        **tensors,
        initial_states=initial_states,
        softplus=dt_softplus,
        chunk_size=chunk_size,
    )
    limit = _check_limit(dt_limit)
    if limit != NO_LIMIT or not dt_softplus:
        step = dt.float() if dt.dtype != torch.float64 else dt
        if dt_bias is not None:
            step = step + dt_bias.to(step.dtype)
        step = F.softplus(step) if dt_softplus else step
        tensors.update(dt=step.clamp(*limit), dt_bias=None)
        dt_softplus = False
    return Inputs(**tensors, dt_softplus=bool(dt_softplus), initial_states=initial_states), chosen


def _check_limit(dt_limit: object) -> tuple[float, float]:
    ok = isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in dt_limit)
    if not ok or not dt_limit[0] <= dt_limit[1]:
        raise ValueError(f"{OP}: dt_limit must be a (low, high) pair of floats, got {dt_limit!r}")
    return float(dt_limit[0]), float(dt_limit[1])


def mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int | None = None,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = NO_LIMIT,
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    *,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's scan, drop-in for mamba-ssm's `mamba_chunk_scan_combined`.

        dt  = softplus(dt + dt_bias) if dt_softplus else dt + dt_bias        (B, L, H)
        dt  = clamp(dt, *dt_limit)                 (always: the default keeps dt >= 0)
        h_t = exp(dt_t A_h) h_{t-1} + dt_t x_t B_t^T      h_t (P, N) per head
        y_t = h_t C_t ;  out = (y + D * x) * silu(z)

    Args:
        x: (B, L, H, P) float32/float16/bfloat16 (float64 on the PyTorch path); H heads of P
            channels.
        dt: (B, L, H), the step sizes before the optional bias and softplus.
        A: (H,) one decay rate per head (Mamba-2's A = -exp(A_log) is negative).
        B: (B, L, G, N) input-dependent, G groups shared by H / G consecutive heads each;
            N from 1 to 256.
        C: (B, L, G, N), like B.
        chunk_size: positions per chunk of the PyTorch path (the result does not depend on
            it); None picks one (mecheval_kernels.ssd.chunked.default_chunk_size). The Triton path
            does not chunk. (mamba-ssm requires it; here it may be left out.)
        D: optional skip, (H,) per head or (H, P) per channel.
        z: optional (B, L, H, P) gate, applied as silu(z) after the skip.
        dt_bias: optional (H,), added to dt before the softplus.
        initial_states: optional (B, H, P, N), the state before position 0; gradients flow to
            it, and through the returned final state, so a scan split at any position and
            resumed from the carried state equals one scan.
        seq_idx, cu_seqlens, return_varlen_states: mamba-ssm's packed sequences; only None,
            None and False are supported (anything else is refused by name).
        dt_softplus: apply softplus to dt + dt_bias.
        dt_limit: (low, high) clamp of the step sizes after the softplus; the default
            (0, inf) clamps negative step sizes to 0, as mamba-ssm does.
        return_final_states: also return the state after the last position.
        backend: "auto", "triton" or "torch"; None uses the process default
            (mecheval_kernels.backend).

    Returns:
        out (B, L, H, P) in x's dtype, or (out, final_states (B, H, P, N) float32). States
        after given positions, the output at one position, a patched state:
        `mecheval_kernels.at_positions(mecheval_kernels.mamba2_scan, ...)`.
    """
    refuse_unsupported(
        OP,
        seq_idx=(seq_idx, None),
        cu_seqlens=(cu_seqlens, None),
        return_varlen_states=(return_varlen_states, False),
    )
    a, chosen = checked(
        backend, x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_states, chunk_size, dt_limit
    )
    if chosen == "triton":
        out, last, _ = on_selective_scan(a, chosen, Asked(return_final_state=True))
    else:
        out, last = ssd_chunked(a, chunk_size)
        last = last.float() if last.dtype != torch.float64 else last
    return (out, last) if return_final_states else out


def _per_channel(t: torch.Tensor, P: int) -> torch.Tensor:
    """A per-head (H,) tensor repeated over each head's P channels: (H * P,)."""
    return t[:, None].expand(t.shape[0], P).reshape(-1)


def on_selective_scan(a: Inputs, backend: str, asked: Asked) -> ScanAt:
    """Mamba-2 as a selective scan at positions over D = H * P channels (channel h * P + p),
    whose group g of B and C covers channels of heads [g H / G, (g + 1) H / G), as Mamba-2's
    does. Returns out (B, L or 1, H, P), the final state (B, H, P, N), the states
    (B, K, H, P, N); the patch values in `asked` (B, H, P, N) are validated by the caller."""
    batch, length, heads, P = a.x.shape
    N = a.B.shape[3]
    channels = lambda t: t.reshape(batch, length, heads * P).transpose(1, 2)  # noqa: E731
    D = a.D
    if D is not None:
        D = _per_channel(D, P) if D.dim() == 1 else D.reshape(-1)
    init = a.initial_states
    if init is not None:
        init = init.reshape(batch, heads * P, N)
    if asked.state_patch is not None:
        positions, values = asked.state_patch
        asked = asked._replace(state_patch=(positions, values.reshape(batch, heads * P, N)))
    scan = dict(
        u=channels(a.x),
        delta=channels(a.dt[..., None].expand(batch, length, heads, P)),
        A=a.A[:, None, None].expand(heads, P, N).reshape(heads * P, N),
        B=a.B.permute(0, 2, 3, 1),  # (B, G, N, L)
        C=a.C.permute(0, 2, 3, 1),
        D=D,
        z=None if a.z is None else channels(a.z),
        delta_bias=None if a.dt_bias is None else _per_channel(a.dt_bias, P),
        delta_softplus=a.dt_softplus,
        initial_state=init,
        backend=backend,
    )
    result = at_positions_of_selective_scan(scan, asked)
    out = result.out.transpose(1, 2).unflatten(-1, (heads, P))
    final, states = result.final_state, result.states
    return ScanAt(
        out,
        None if final is None else final.reshape(batch, heads, P, N),
        None if states is None else states.reshape(batch, -1, heads, P, N),
    )
