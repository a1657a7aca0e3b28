"""`mamba2_scan`: Mamba-2's scan (SSD) with mamba-ssm's `mamba_chunk_scan_combined` layouts.

Two implementations, chosen by the backend (kernels.backend):
  "torch"   the chunked SSD algorithm in PyTorch (kernels.ssd.chunked), differentiated by
            autograd: runs under torch.vmap and torch.compile as plain PyTorch does.
  "triton"  Mamba-2 as a selective scan (`_on_selective_scan`): the head's scalar A broadcast
            over its channels and state indices, dt broadcast from heads to channels, B and C
            as groups of channels; the selective scan's Triton kernels (and their backward,
            vmap rule and custom op) then run it.
The selective-scan form is also what returns states at given positions (`states_at`), on
either backend. docs/kernels.md has the measurements behind the choice.
"""

from __future__ import annotations

import torch

from kernels.backend import resolve_backend
from kernels.selective_scan import selective_scan_fn
from kernels.selective_scan.op import MAX_STATE
from kernels.ssd.chunked import ssd_chunked
from kernels.validation import (
    allowed_dtypes,
    check_choice,
    check_positions,
    check_range,
    check_same_device,
    check_tensor,
    check_tensor_layouts,
)

OP = "mamba2_scan"


def _validate(dtypes, x, dt, A, B, C, D, z, dt_bias, initial_states, softplus, chunk_size):
    sizes: dict[str, int] = {}
    check_tensor(OP, "x", x, "B L H P", sizes, dtypes)
    for dim, what in (("B", "batch"), ("L", "length"), ("H", "heads"), ("P", "head dim")):
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
    for name, t, dims in (
        ("z", z, "B L H P"),
        ("dt_bias", dt_bias, "H"),
        ("initial_states", initial_states, "B H P N"),
    ):
        if t is not None:
            check_tensor(OP, name, t, dims, sizes, dtypes)
    check_choice(OP, "dt_softplus", softplus, (False, True))
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"{OP}: chunk_size must be None or an int >= 1, got {chunk_size!r}")


def mamba2_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    *,
    states_at: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Mamba-2's scan, with the layouts of mamba-ssm's `mamba_chunk_scan_combined` (which also
    takes a `chunk_size`, here optional and keyword-only).

        dt  = softplus(dt + dt_bias) if dt_softplus else dt + dt_bias        (B, L, H)
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
        D: optional skip, (H,) per head or (H, P) per channel.
        z: optional (B, L, H, P) gate, applied as silu(z) after the skip.
        dt_bias: optional (H,), added to dt before the softplus.
        dt_softplus: apply softplus to dt + dt_bias.
        initial_states: optional (B, H, P, N), the state before position 0; gradients flow to
            it, and through the returned final state, so a scan split at any position and
            resumed from the carried state equals one scan.
        return_final_states: also return the state after the last position.
        states_at: (ours) optional (B, K) integer positions: also return the states after
            positions states_at[b, :] of each row b (see `selective_scan_fn`'s states_at).
        chunk_size: (ours) positions per chunk of the PyTorch path; None picks one
            (kernels.ssd.chunked.default_chunk_size). The Triton path does not chunk.
        backend: "auto", "triton" or "torch"; None uses the process default (kernels.backend).

    Returns:
        out (B, L, H, P) in x's dtype; then final_states (B, H, P, N) float32 if
        `return_final_states`; then the states (B, K, H, P, N) float32 if `states_at` is given.
    """
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
    states = None
    if states_at is not None:
        at = check_positions(OP, states_at, x.shape[0], x.shape[1], device)
        out, last, states = _on_selective_scan(
            **tensors,
            dt_softplus=bool(dt_softplus),
            initial_states=initial_states,
            at=at,
            backend=chosen,
        )
    elif chosen == "triton":
        out, last, _ = _on_selective_scan(
            **tensors,
            dt_softplus=bool(dt_softplus),
            initial_states=initial_states,
            at=None,
            backend=chosen,
        )
    else:
        out, last = ssd_chunked(
            **tensors,
            dt_softplus=bool(dt_softplus),
            initial_states=initial_states,
            chunk_size=chunk_size,
        )
        last = last.float() if last.dtype != torch.float64 else last
    result = (out,)
    if return_final_states:
        result += (last,)
    if states is not None:
        result += (states,)
    return result[0] if len(result) == 1 else result


def _per_channel(t: torch.Tensor, P: int) -> torch.Tensor:
    """A per-head (H,) tensor repeated over each head's P channels: (H * P,)."""
    return t[:, None].expand(t.shape[0], P).reshape(-1)


def _on_selective_scan(x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_states, at, backend):
    """Mamba-2 as a selective scan over D = H * P channels (channel h * P + p), whose group
    g of B and C covers channels of heads [g H / G, (g + 1) H / G), as Mamba-2's does.
    Returns (out (B, L, H, P), final state (B, H, P, N), states (B, K, H, P, N) or None)."""
    batch, length, heads, P = x.shape
    N = B.shape[3]
    channels = lambda t: t.reshape(batch, length, heads * P).transpose(1, 2)  # noqa: E731
    u = channels(x)
    delta = channels(dt[..., None].expand(batch, length, heads, P))
    A_full = A[:, None, None].expand(heads, P, N).reshape(heads * P, N)
    if D is not None:
        D = _per_channel(D, P) if D.dim() == 1 else D.reshape(-1)
    init = None if initial_states is None else initial_states.reshape(batch, heads * P, N)
    result = selective_scan_fn(
        u,
        delta,
        A_full,
        B.permute(0, 2, 3, 1),  # (B, G, N, L)
        C.permute(0, 2, 3, 1),
        D,
        None if z is None else channels(z),
        None if dt_bias is None else _per_channel(dt_bias, P),
        dt_softplus,
        True,
        init,
        states_at=at,
        backend=backend,
    )
    out, last = result[0], result[1]
    out = out.transpose(1, 2).reshape(batch, length, heads, P)
    states = None if at is None else result[2].reshape(batch, -1, heads, P, N)
    return out, last.reshape(batch, heads, P, N), states
