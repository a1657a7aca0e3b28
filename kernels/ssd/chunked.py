"""The PyTorch path of Mamba-2's scan (the CPU fast path): the chunked SSD algorithm of Dao & Gu
(2024), differentiated by autograd.

Positions are cut into chunks of Q. Inside a chunk the scan is a masked matrix product (the
"diagonal blocks": y_l = sum_{s <= l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s, with
a = dt * A); across chunks only the states at chunk boundaries are carried, one small loop step
per chunk. Nothing of size (positions x channels x state) is materialised, which is what makes
it several times faster than running Mamba-2 as a selective scan on a CPU (docs/kernels.md).
Products over B and C are taken once per group, not once per head.

Decays enter as exp of sums of a over segments, each sum taken directly (a masked cumulative
sum per row), never as a difference of two long cumulative sums: a very negative a_t (a large
dt) would otherwise wipe out the precision of every later difference in float32.

Non-finite inputs stay causal, as in the per-position recurrence: the masked products multiply
later positions by zeros, and 0 * NaN is NaN, so a NaN at position t would reach the outputs
before t. The scan therefore runs on x, dt, B, C and z with every non-finite entry set to zero,
and then marks non-finite what the recurrence makes non-finite: from t on, channel p of a head
for a non-finite x[t, p], every channel of the head for a non-finite dt[t] or a non-finite
B[t] of its group (the state), and at t alone the head's outputs for a non-finite C[t] of its
group, channel p for a non-finite z[t, p]. Finite inputs give exactly what they gave without
this. (A non-finite A, D, dt_bias or initial state reaches every position anyway.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mecheval_kernels.ssd.reference import step_sizes
from mecheval_kernels.stacking import is_batched

# Chunk length: one chunk up to this many positions, else CHUNK (measured on the study's
# shapes, docs/kernels.md: one chunk is fastest for L <= 64, chunks of 32 for L = 256).
ONE_CHUNK_MAX = 64
CHUNK = 32


def default_chunk_size(length: int) -> int:
    return length if length <= ONE_CHUNK_MAX else CHUNK


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a (..., Q) -> (..., Q, Q): [l, s] = a_{s+1} + ... + a_l for l >= s (0 on the diagonal),
    -inf above it."""
    Q = a.shape[-1]
    ones = torch.ones(Q, Q, dtype=torch.bool, device=a.device)
    below, on_or_below = ones.tril(-1), ones.tril(0)
    rows = a[..., :, None].expand(*a.shape, Q).masked_fill(~below, 0.0)  # [l, s] = a_l, l > s
    return rows.cumsum(dim=-2).masked_fill(~on_or_below, -torch.inf)


def _segment_rows(a: torch.Tensor, l: torch.Tensor | None = None) -> torch.Tensor:
    """Row l of `_segment_sums(a)` alone: a (..., Q), l (...) -> (..., Q), [s] = a_{s+1} + ...
    + a_l for s <= l, -inf after; l None: the last row (the decay from s to the chunk's end).
    Each sum is taken directly, from the right."""
    if l is not None:
        after = torch.arange(a.shape[-1], device=a.device) > l[..., None]
        a = a.masked_fill(after, 0.0)
    rows = F.pad(a.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))
    return rows if l is None else rows.masked_fill(after, -torch.inf)


def _pad_positions(t: torch.Tensor, pad: int) -> torch.Tensor:
    """Zeros appended on axis 1 (positions): no input and no decay there."""
    if not pad:
        return t
    return F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))


def _all_finite(*tensors: torch.Tensor | None) -> bool:
    """Whether every entry is known to be finite, so that the masking passes can be skipped:
    one sum per tensor, read on CPU and outside torch.compile only (elsewhere the read would be
    a sync, or a graph break). Under torch.vmap (stacked models) the sums are of the tensors
    holding every model's entries. A sum of finite values that overflows only sends them down
    the exact, slower way."""
    if torch.compiler.is_compiling() or tensors[0].device.type != "cpu":
        return False
    sums = torch.stack([_unbatched(t).sum(dtype=torch.float32) for t in tensors if t is not None])
    return bool(torch.isfinite(sums).all())


def _unbatched(t: torch.Tensor) -> torch.Tensor:
    """`t` itself, or under torch.vmap the tensor of all its batch entries (a value read from
    it, unlike one read from `t`, may steer Python)."""
    while is_batched(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def _zeroed(t: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(t with its non-finite entries set to 0, where they were); (None, None) for None."""
    if t is None:
        return None, None
    bad = ~torch.isfinite(t)
    return t.masked_fill(bad, 0), bad


class Inputs(NamedTuple):
    """mamba2_scan's validated inputs, the custom op's `Args` (dt_limit folded into dt when it
    clamps; chunk_size 0: `default_chunk_size`; save_checkpoints: the Triton path keeps its
    chunks' start states for a backward)."""

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor | None
    z: torch.Tensor | None
    dt_bias: torch.Tensor | None
    dt_softplus: bool
    initial_states: torch.Tensor | None
    chunk_size: int = 0
    save_checkpoints: bool = False


def ssd_chunked(a: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's scan on inputs validated by `mecheval_kernels.mamba2_scan`: (out (B, L, H, P) in
    x's dtype, final state (B, H, P, N) in the compute dtype: float32, float64 for float64 x)."""
    if _all_finite(a.x, a.dt, a.B, a.C, a.z):
        return ssd_chunked_states(a)[:2]
    (x, bad_x), (dt, bad_dt), (z, bad_z) = _zeroed(a.x), _zeroed(a.dt), _zeroed(a.z)
    (B, bad_B), (C, bad_C) = _zeroed(a.B), _zeroed(a.C)
    out, state, _ = ssd_chunked_states(a._replace(x=x, dt=dt, B=B, C=C, z=z))
    # From t on: rows p of the state (B, L, H, P) for x and dt, its columns (B, L, H, N) for
    # B; an output reads every column.
    per_head = x.shape[2] // B.shape[2]
    rows = (bad_x | bad_dt[..., None]).cummax(dim=1).values
    columns = bad_B.repeat_interleave(per_head, 2).cummax(dim=1).values
    at_t = bad_C.any(-1).repeat_interleave(per_head, 2)[..., None]
    if bad_z is not None:
        at_t = at_t | bad_z
    out = out.masked_fill(rows | columns.any(-1, keepdim=True) | at_t, torch.nan)
    final = rows[:, -1, :, :, None] | columns[:, -1, :, None, :]  # (B, H, P, N)
    return out, state.masked_fill(final, torch.nan)


def finite_inputs(a: Inputs) -> bool:
    """Whether x, dt, B, C and z are known to be all finite (see `_all_finite`)."""
    return _all_finite(a.x, a.dt, a.B, a.C, a.z)


def ssd_chunked_states(
    inputs: Inputs,
    states_at: torch.Tensor | None = None,
    out_at: torch.Tensor | None = None,
    final: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`ssd_chunked` on inputs that are all finite (`finite_inputs`), with the states after
    `states_at` (B, K) (B, K, H, P, N), each formed from the state entering its chunk and the
    chunk's inputs up to it; with `out_at` (B,) the output at that position of each row alone
    (B, 1, H, P), its chunk's row of the masked matrix and the state entering the chunk; the
    final state None unless `final`."""
    x, dt, A, B, C, D, z, dt_bias, dt_softplus, initial_states, chunk_size, _ = inputs
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    batch, length, heads, P = x.shape
    groups, N = B.shape[2], B.shape[3]
    per_group = heads // groups
    Q = min(chunk_size, length) if chunk_size else default_chunk_size(length)

    x_c = x.to(compute)
    step = step_sizes(dt, dt_bias, dt_softplus, compute)
    pad = (-length) % Q
    chunks = (length + pad) // Q
    xdt = _pad_positions(x_c * step[..., None], pad).view(batch, chunks, Q, groups, per_group, P)
    a = _pad_positions(step * A.to(compute), pad).view(batch, chunks, Q, groups, per_group)
    a = a.permute(0, 1, 3, 4, 2)  # (B, c, G, R, Q)
    B_c = _pad_positions(B.to(compute), pad).view(batch, chunks, Q, groups, N)
    C_c = _pad_positions(C.to(compute), pad).view(batch, chunks, Q, groups, N)
    from_start = torch.exp(a.cumsum(dim=-1))  # decay from the chunk's start to l (inclusive)
    # The masked decay matrices of every chunk where every output is asked for; else the rows
    # that are read alone.
    segments = _segment_sums(a) if out_at is None else None  # (B, c, G, R, Q, Q)

    # The states entering each chunk, carried from chunk to chunk with each chunk's own
    # contribution to the state at its end (not formed where nothing reads it).
    if initial_states is None:
        state = x_c.new_zeros(batch, groups, per_group, P, N)
    else:
        state = initial_states.to(compute).reshape(batch, groups, per_group, P, N)
    entering = [state]
    if chunks > 1 or final:
        # (B, c, G, R, Q): the decay from s to the chunk's end
        to_end = torch.exp(_segment_rows(a) if segments is None else segments[..., -1, :])
        own = torch.einsum("bcsgn,bcgrs,bcsgrp->bcgrpn", B_c, to_end, xdt)
        for c in range(chunks):
            state = from_start[:, c, :, :, -1, None, None] * state + own[:, c]
            entering.append(state)
    entering = torch.stack(entering[:chunks], dim=1)  # (B, c, G, R, P, N)
    started = initial_states is not None or chunks > 1  # whether any state enters a chunk

    rows = torch.arange(batch, device=x.device)
    if out_at is None:
        # Within each chunk: the masked (C B^T) * decay matrix applied to dt x.
        scores = torch.einsum("bclgn,bcsgn->bcgls", C_c, B_c)[:, :, :, None] * segments.exp()
        y = torch.einsum("bcgrls,bcsgrp->bclgrp", scores, xdt)
        if started:
            carried = torch.einsum("bclgn,bcgrpn->bclgrp", C_c, entering)
            y = y + carried * from_start.permute(0, 1, 4, 2, 3)[..., None]
        out, x_out, z_out = y.reshape(batch, chunks * Q, heads, P)[:, :length], x_c, z
    else:  # the chunk's row of the masked matrix at each row's position alone
        y = _output_at(out_at, Q, a, xdt, B_c, C_c, from_start, entering if started else None)
        out, x_out = y.reshape(batch, 1, heads, P), x_c[rows, out_at][:, None]
        z_out = None if z is None else z[rows, out_at][:, None]
    if D is not None:
        skip = D.to(compute)
        out = out + (skip[:, None] if skip.dim() == 1 else skip) * x_out
    if z_out is not None:
        out = out * F.silu(z_out.to(compute))
    states = None
    if states_at is not None:
        states = _states_after(states_at, Q, a, xdt, B_c, from_start, entering)
        states = states.reshape(batch, -1, heads, P, N)
    last = state.reshape(batch, heads, P, N) if final else None
    return out.to(x.dtype), last, states


def _chunk_of(t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """t (B, chunks, ...) at each row's chunk c (B,) or (B, K): a view for one chunk."""
    if t.shape[1] > 1:
        rows = torch.arange(t.shape[0], device=t.device)
        return t[rows if c.dim() == 1 else rows[:, None], c]
    t = t[:, 0]
    return t if c.dim() == 1 else t[:, None].expand(-1, c.shape[1], *t.shape[1:])


def _output_at(out_at, Q, a, xdt, B_c, C_c, from_start, entering) -> torch.Tensor:
    """y (B, G, R, P) at out_at (B,) alone: its chunk's row of the masked matrix applied to dt x,
    plus the state entering the chunk read by C there (`entering` None: no state enters)."""
    rows = torch.arange(out_at.shape[0], device=out_at.device)
    c, l = out_at // Q, out_at % Q
    query = C_c[rows, c, l]  # (B, G, N)
    scores = torch.einsum("bgn,bsgn->bgs", query, _chunk_of(B_c, c))[:, :, None]
    scores = scores * torch.exp(_segment_rows(_chunk_of(a, c), l[:, None, None]))  # (B, G, R, Q)
    y = torch.einsum("bgrs,bsgrp->bgrp", scores, _chunk_of(xdt, c))
    if entering is not None:
        carried = torch.einsum("bgn,bgrpn->bgrp", query, _chunk_of(entering, c))
        y = y + carried * from_start[rows, c, :, :, l][..., None]
    return y


def _states_after(states_at, Q, a, xdt, B_c, from_start, entering) -> torch.Tensor:
    """The states (B, K, G, R, P, N) after states_at (B, K): state_t = the decay from its
    chunk's start times the state entering the chunk, plus the chunk's inputs up to t. Where
    at least half the positions up to the last one asked for are asked for, and without
    gradients, the recurrence state_t = exp(a_t) state_{t-1} + dt_t x_t B_t^T, stepped in place,
    costs less (`_states_stepped`)."""
    last = int(states_at.max()) + 1
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (a, xdt, B_c, entering))
    if 2 * states_at.shape[1] >= last and not grads:
        return _states_stepped(states_at, last, a, xdt, B_c, entering[:, 0])
    rows = torch.arange(states_at.shape[0], device=states_at.device)[:, None]
    c, l = states_at // Q, states_at % Q
    decays = torch.exp(_segment_rows(_chunk_of(a, c), l[..., None, None]))  # (B, K, G, R, Q)
    weighted = _chunk_of(xdt, c).permute(0, 1, 3, 4, 5, 2) * decays[..., None, :]  # (R, P, Q)
    keys = _chunk_of(B_c, c).transpose(2, 3)  # (B, K, G, Q, N)
    inside = (weighted.flatten(3, 4) @ keys).view(*weighted.shape[:-1], keys.shape[-1])
    return from_start[rows, c, :, :, l][..., None, None] * _chunk_of(entering, c) + inside


def _states_stepped(states_at, last, a, xdt, B_c, initial) -> torch.Tensor:
    """`_states_after` by the recurrence over positions 0 .. last - 1 (the last position asked
    for plus one) from `initial`, each state written into its slot of the result."""
    batch, chunks, Q = xdt.shape[:3]
    a = a.permute(0, 1, 4, 2, 3).reshape(batch, chunks * Q, *a.shape[2:4])[:, :last]
    xdt = xdt.reshape(batch, chunks * Q, *xdt.shape[3:])[:, :last]  # (B, T, G, R, P)
    keys = B_c.reshape(batch, chunks * Q, *B_c.shape[3:])[:, :last]  # (B, T, G, N)
    decays = a.exp()[..., None, None]
    states = initial.new_empty(batch, last, *initial.shape[1:])
    state = initial
    for t in range(last):
        torch.mul(decays[:, t], state, out=states[:, t])
        state = states[:, t].addcmul_(xdt[:, t, ..., None], keys[:, t, :, None, None, :])
    in_order = torch.arange(last, device=states_at.device)
    if states_at.shape[1] == last and bool((states_at == in_order).all()):
        return states  # every position, in order
    rows = torch.arange(states_at.shape[0], device=states_at.device)[:, None]
    return states[rows, states_at]
