"""`mamba2_scan`: Mamba-2's scan (SSD) with mamba-ssm's `mamba_chunk_scan_combined` layouts, on
the ops' scaffold (mecheval_kernels._op; custom ops `mecheval_kernels::mamba2_scan_fwd`/`_bwd`).

Two implementations, chosen by the backend (mecheval_kernels.backend):
  "torch"   torch_path.py: the chunked SSD algorithm in PyTorch (mecheval_kernels.ssd.chunked).
  "triton"  launch.py: Mamba-2 as a selective scan (`on_selective_scan`): the head's scalar A
            broadcast over its channels and state indices, dt broadcast from heads to
            channels, B and C as groups of channels; the selective scan's Triton kernels run it.
Each backward is the vector-Jacobian product of its recomputed forward (only the inputs are
kept, as Mamba-3's core). The selective-scan form also runs the scan at positions on the Triton
path (mecheval_kernels.ssd.at). docs/kernels.md has the measurements behind the choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mecheval_kernels._op import Op, compute_dtype, needs_grad
from mecheval_kernels.scan_at import Asked, ScanAt
from mecheval_kernels.selective_scan.at import at_positions_of_selective_scan
from mecheval_kernels.selective_scan.op import MAX_STATE
from mecheval_kernels.ssd.chunked import Inputs, ssd_chunked
from mecheval_kernels.stacking import fold_into, unfold_from
from mecheval_kernels.validation import (
    check_batch,
    check_choice,
    check_range,
    check_tensor,
    check_tensor_layouts,
    refuse_unsupported,
)

NAME = "mamba2_scan"


def _validate(dtypes, x, dt, A, B, C, D, z, dt_bias, initial_states, dt_softplus, chunk_size):
    sizes: dict[str, int] = {}
    check_tensor(NAME, "x", x, "B L H P", sizes, dtypes)
    check_batch(NAME, "x", sizes["B"])
    for dim, what in (("L", "length"), ("H", "heads"), ("P", "head dim")):
        if sizes[dim] < 1:
            raise ValueError(f"{NAME}: x must have {what} {dim} >= 1, got shape {tuple(x.shape)}")
    check_tensor(NAME, "dt", dt, "B L H", sizes, dtypes)
    check_tensor(NAME, "A", A, "H", sizes, dtypes)
    check_tensor(NAME, "B", B, "B L G N", sizes, dtypes)
    check_range(NAME, "state size N (B.shape[3])", sizes["N"], 1, MAX_STATE)
    if sizes["G"] < 1 or sizes["H"] % sizes["G"]:
        raise ValueError(
            f"{NAME}: the number of groups of B and C (G = {sizes['G']}, B of shape (B, L, G, N) "
            f"= {tuple(B.shape)}) must divide the heads H = {sizes['H']}"
        )
    check_tensor(NAME, "C", C, "B L G N", sizes, dtypes)
    if D is not None:
        check_tensor_layouts(NAME, "D", D, ("H", "H P"), sizes, dtypes)
    check_tensor(NAME, "z", z, "B L H P", sizes, dtypes, optional=True)
    check_tensor(NAME, "dt_bias", dt_bias, "H", sizes, dtypes, optional=True)
    check_tensor(NAME, "initial_states", initial_states, "B H P N", sizes, dtypes, optional=True)
    check_choice(NAME, "dt_softplus", dt_softplus, (False, True))
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"{NAME}: chunk_size must be None or an int >= 1, got {chunk_size!r}")


NO_LIMIT = (0.0, float("inf"))


def checked(backend, x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_states, chunk_size,
            dt_limit=NO_LIMIT) -> tuple[Inputs, str]:  # fmt: skip
    """(the validated inputs, the backend that runs them). The step sizes are clamped to
    dt_limit after the bias and softplus, the default (0, inf) included, as mamba-ssm's
    kernel always clamps: where the clamp can change them (a limit other than (0, inf), or no
    softplus to keep them >= 0) they are formed here and passed on as they are."""
    tensors = dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias)
    chosen = OP.check(
        backend, **tensors, initial_states=initial_states, dt_softplus=dt_softplus,
        chunk_size=chunk_size,
    )  # fmt: skip
    limit = _check_limit(dt_limit)
    if limit != NO_LIMIT or not dt_softplus:
        step = dt.float() if dt.dtype != torch.float64 else dt
        if dt_bias is not None:
            step = step + dt_bias.to(step.dtype)
        step = F.softplus(step) if dt_softplus else step
        tensors.update(dt=step.clamp(*limit), dt_bias=None)
        dt_softplus = False
    inputs = Inputs(
        **tensors, dt_softplus=bool(dt_softplus), initial_states=initial_states,
        chunk_size=chunk_size or 0,
    )  # fmt: skip
    return inputs, chosen


def _check_limit(dt_limit: object) -> tuple[float, float]:
    ok = isinstance(dt_limit, (tuple, list)) and len(dt_limit) == 2
    ok = ok and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in dt_limit)
    if not ok or not dt_limit[0] <= dt_limit[1]:
        raise ValueError(f"{NAME}: dt_limit must be a (low, high) pair of floats, got {dt_limit!r}")
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
        NAME,
        seq_idx=(seq_idx, None),
        cu_seqlens=(cu_seqlens, None),
        return_varlen_states=(return_varlen_states, False),
    )
    a, chosen = checked(
        backend, x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_states, chunk_size, dt_limit
    )
    out, last = run(a, chosen)
    return (out, last) if return_final_states else out


def run(a: Inputs, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, the final state) of validated inputs on `backend`."""
    if backend == "torch" and OP.eager(a):
        # Eagerly, autograd differentiates the chunked form as it runs (the op's backward
        # would recompute it: twice the time of a forward and backward at the study's sizes).
        return ssd_chunked(a)
    # The Triton backward's checkpoints only when autograd will ask for a backward.
    out, last, _ = OP(a._replace(save_checkpoints=needs_grad(a)), backend)
    return out, last


def _fake(a: Inputs, backend: str) -> tuple:
    batch, length, heads, P = a.x.shape
    N = a.B.shape[3]
    final = a.x.new_empty(batch, heads, P, N, dtype=compute_dtype(a.x))
    count = 0
    if backend == "triton" and a.save_checkpoints:
        count = OP.implementation(backend).num_checkpoints(batch, heads * P, N, length)
    kept = a.x.new_empty(count, batch, heads * P, N, dtype=compute_dtype(a.x))
    return a.x.new_empty(a.x.shape), final, kept  # contiguous, as both paths return it


def _fold(a: Inputs, dims: Inputs, m: int):
    """Stacked models (mecheval_kernels.stacking): the model axis folds into the heads and the
    groups (model k's head h reads its group h // (H / G) as head k H + h reads k G + that)."""
    folded = a._replace(
        **{f: fold_into(getattr(a, f), getattr(dims, f), m, 2) for f in ("x", "dt", "B", "C", "z")},
        **{f: fold_into(getattr(a, f), getattr(dims, f), m, 0) for f in ("A", "D", "dt_bias")},
        initial_states=fold_into(a.initial_states, dims.initial_states, m, 1),
    )
    folded = folded._replace(save_checkpoints=needs_grad(folded))  # unseen through the vmap
    return folded, lambda i, t: unfold_from(t, m, (2, 1)[i]) if i < 2 else (t, None)


def _twice(a: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """out and the final state recomputed in the chunked form (plain PyTorch), for second
    derivatives."""
    return ssd_chunked(a)


OP = Op(
    __package__, NAME, Inputs, "B L H P", _validate, _fake, 3, 1, _fold, name=NAME, twice=_twice
)


def _per_channel(t: torch.Tensor, P: int) -> torch.Tensor:
    """A per-head (H,) tensor repeated over each head's P channels: (H * P,)."""
    return t[:, None].expand(t.shape[0], P).reshape(-1)


def selective_form(a: Inputs) -> dict:
    """Mamba-2 as `selective_scan_fn`'s arguments by name (backend aside) over D = H * P
    channels (channel h * P + p), whose group g of B and C covers channels of heads
    [g H / G, (g + 1) H / G), as Mamba-2's does."""
    batch, length, heads, P = a.x.shape
    N = a.B.shape[3]
    channels = lambda t: t.reshape(batch, length, heads * P).transpose(1, 2)  # noqa: E731
    D = a.D
    if D is not None:
        D = _per_channel(D, P) if D.dim() == 1 else D.reshape(-1)
    init = a.initial_states
    return dict(
        u=channels(a.x),
        delta=channels(a.dt[..., None].expand(batch, length, heads, P)),
        A=a.A[:, None, None].expand(heads, P, N).reshape(heads * P, N),
        B=a.B.permute(0, 2, 3, 1),  # (B, G, N, L)
        C=a.C.permute(0, 2, 3, 1),
        D=D,
        z=None if a.z is None else channels(a.z),
        delta_bias=None if a.dt_bias is None else _per_channel(a.dt_bias, P),
        delta_softplus=a.dt_softplus,
        initial_state=None if init is None else init.reshape(batch, heads * P, N),
    )


def on_selective_scan(a: Inputs, backend: str, asked: Asked) -> ScanAt:
    """Mamba-2 as a selective scan at positions (`selective_form`). Returns out (B, L or 1, H,
    P), the final state (B, H, P, N), the states (B, K, H, P, N); the patch values in `asked`
    (B, H, P, N) are validated by the caller."""
    batch, _, heads, P = a.x.shape
    N = a.B.shape[3]
    if asked.state_patch is not None:
        positions, values = asked.state_patch
        asked = asked._replace(state_patch=(positions, values.reshape(batch, heads * P, N)))
    result = at_positions_of_selective_scan({**selective_form(a), "backend": backend}, asked)
    out = result.out.transpose(1, 2).unflatten(-1, (heads, P))
    final, states = result.final_state, result.states
    return ScanAt(
        out,
        None if final is None else final.reshape(batch, heads, P, N),
        None if states is None else states.reshape(batch, -1, heads, P, N),
    )
