"""The PyTorch path of the selective scan (the CPU fast path), with a hand-written backward.

Everything but the time recurrence is vectorised. Rows of the batch are processed in tiles and
positions in chunks of T, so that a few (T, rows, D, N) buffers stay within a fixed memory budget
(large batches, such as the stacked cells of an intervention grid, would otherwise get chunks of
one position and buffers far larger than the cache: tiling rows is about twice as fast there).
Inside a chunk the recurrence is one fused multiply-add per position on a time-major buffer, and
contractions over N or over channels are batched matrix products.

The forward keeps only the state at the start of each chunk (the checkpoints). The backward
walks the chunks in reverse: it recomputes the chunk's states from its checkpoint, runs the
adjoint recurrence backwards (dh_t = g_t C_t + exp(dt_{t+1} A) dh_{t+1}) and forms every
gradient from the two (kernels.selective_scan.torch_backward). Autograd through the
per-position loop would record every step and is orders of magnitude slower (see
docs/kernels.md).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels._op import compute_dtype
from kernels.layout import match_layout
from kernels.selective_scan.op import ScanArgs

LOG2E = math.log2(math.e)
# Elements of one (T, rows, D, N) chunk buffer; the backward holds about six of them.
CHUNK_ELEMENTS = 1 << 20
# Batch tiles are sized so that a chunk holds at least this many positions.
MIN_CHUNK = 4


def tile_rows(batch: int, channels: int, state: int, length: int) -> int:
    """Batch rows per tile: as many as leave room for chunks of MIN_CHUNK positions (or of the
    whole sequence, when shorter: short segments of a split scan then take few tiles)."""
    positions = min(MIN_CHUNK, length)
    return max(1, min(batch, CHUNK_ELEMENTS // (channels * state * positions)))


def chunk_length(batch: int, channels: int, state: int, length: int) -> int:
    """Positions per chunk: as many as fit the buffer budget with one tile of rows, >= 1."""
    rows = tile_rows(batch, channels, state, length)
    return max(1, min(length, CHUNK_ELEMENTS // (rows * channels * state)))


def _tiles(batch: int, channels: int, state: int, length: int) -> list[slice]:
    rows = tile_rows(batch, channels, state, length)
    return [slice(r, min(batch, r + rows)) for r in range(0, batch, rows)]


def _per_row(name: str, x: torch.Tensor | None) -> bool:
    """Whether an input (or its gradient) has a batch axis first (B and C only when not (D, N))."""
    if not isinstance(x, torch.Tensor) or name in ("A", "D", "delta_bias"):
        return False
    return x.dim() > 2 if name in ("B", "C") else True


def _rows_of(a: ScanArgs, rows: slice) -> ScanArgs:
    return ScanArgs(*(x[rows] if _per_row(n, x) else x for n, x in a._asdict().items()))


def num_checkpoints(batch: int, channels: int, state: int, length: int) -> int:
    """Number of chunk-start states the forward saves for the backward."""
    t = chunk_length(batch, channels, state, length)
    return (length + t - 1) // t


# B and C come in three layouts. `_time_major_bc` lays one out with positions first (once per
# call: strided reads of B or C inside the chunk loop are several times slower), `_chunk` cuts
# positions [t0, t1) out of that, and the helpers below broadcast, contract or differentiate a
# chunk against the (T, B, D, N) states without materialising a per-channel copy of it.


def _time_major_bc(X: torch.Tensor) -> torch.Tensor:
    if X.dim() == 2:  # (D, N): the same at every position
        return X
    if X.dim() == 3:  # (B, N, L) -> (L, B, N)
        return X.permute(2, 0, 1).contiguous()
    return X.permute(3, 0, 1, 2).contiguous()  # (B, G, N, L) -> (L, B, G, N)


def _chunk(Xt: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    return Xt if Xt.dim() == 2 else Xt[t0:t1]


def _sum_last(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1) as a matrix-vector product (a short last dimension sums slowly)."""
    ones = x.new_ones(x.shape[-1])
    return (x.reshape(-1, x.shape[-1]) @ ones).view(x.shape[:-1])


def _outer(w: torch.Tensor, Xc: torch.Tensor, X: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """w (T, B, D) times X, written to `out` (T, B, D, N) and returned."""
    if X.dim() == 2:
        return torch.mul(w[..., None], Xc, out=out)
    if X.dim() == 3:
        return torch.mul(w[..., None], Xc[:, :, None, :], out=out)
    T, batch, channels, N = out.shape
    groups = Xc.shape[2]
    per_group = (T, batch, groups, channels // groups)
    torch.mul(w.reshape(*per_group, 1), Xc[:, :, :, None, :], out=out.view(*per_group, N))
    return out


def _inner(states: torch.Tensor, Xc: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """sum_n states * X: (T, B, D). For a (B, N, L) X, one batched (D, N) x (N, 1) product per
    position and row (reads the states once: on CPU with torch 2.13, 5-10% off a whole scan
    against a multiply into a buffer and a matrix-vector product)."""
    if X.dim() == 2:
        return _sum_last(states * Xc)
    if X.dim() == 3:
        return (states @ Xc[..., None]).squeeze(-1)
    T, batch, channels, N = states.shape
    groups = Xc.shape[2]
    per_group = states.reshape(T, batch, groups, channels // groups, N) @ Xc[..., None]
    return per_group.reshape(T, batch, channels)


def _time_major(x: torch.Tensor) -> torch.Tensor:
    """(B, D, L) -> contiguous (L, B, D)."""
    return x.permute(2, 0, 1).contiguous()


def _scan_chunk(
    dt: torch.Tensor,
    u: torch.Tensor,
    A_log2: torch.Tensor,
    Bc: torch.Tensor,
    B: torch.Tensor,
    h0: torch.Tensor | None,
    a: torch.Tensor,
    h: torch.Tensor,
    replace: dict | None = None,
) -> None:
    """Decays a = exp(dt A) and states h of one chunk, both (T, B, D, N), written into the given
    buffers (reused across chunks: large fresh allocations cost page faults on CPU), from the
    state h0 before the chunk (None: zero). A_log2 is A log2(e): exp2 is about 2.5x faster than
    exp on CPU, and the decay is the scan's costliest step. `replace`: states patched within
    the chunk (see `_replace`)."""
    torch.mul(dt[..., None], A_log2, out=a)
    a.exp2_()
    _outer(dt * u, Bc, B, h)  # dt * B * u, turned into the states in place
    if h0 is not None:
        h[0].addcmul_(a[0], h0)
    _replace(h, 0, replace)
    for i in range(1, h.shape[0]):
        h[i].addcmul_(a[i], h[i - 1])
        _replace(h, i, replace)


def _replace(h: torch.Tensor, i: int, replace: dict | None) -> None:
    """Step i's states of the rows `replace` patches there: replace[i] = (rows, values, kept),
    the unpatched states stored into `kept` (the output at the patched position reads them)."""
    if replace and i in replace:
        rows, values, kept = replace[i]
        kept.copy_(h[i, rows])
        h[i, rows] = values


def _chunk_buffers(count: int, T: int, like: torch.Tensor, N: int, compute: torch.dtype):
    batch, channels, _ = like.shape
    return [like.new_empty(T, batch, channels, N, dtype=compute) for _ in range(count)]


def forward(a: ScanArgs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (B, D, L) in u's dtype and layout, last_state (B, D, N), checkpoints (K, B, D, N));
    K = 0 when not `save_checkpoints` (no backward will run: inference)."""
    out, last_state, checkpoints, _ = _forward(a, None)
    return out, last_state, checkpoints


def forward_states_at(
    a: ScanArgs, at: torch.Tensor, out_at: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """(out, last_state, the states after positions at[b, :] of each row b (B, P, D, N) in the
    compute dtype), without gradients: each chunk of the scan picks the states it computes.
    With `out_at` (B,), out is (B, D, 1) at those positions (see `forward_out_at`)."""
    out, last_state, _, states = _forward(a._replace(save_checkpoints=False), at, out_at)
    return out, last_state, states


def forward_patched(
    a: ScanArgs,
    positions: torch.Tensor,
    values: torch.Tensor,
    at: torch.Tensor | None,
    out_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(out, last_state, the states after positions at[b, :] or None) of the scan whose state
    after positions[b] (B,) is replaced with values[b] (B, D, N), without gradients: outputs
    after it and the states from it on are the patched scan's, the output at it is not. With
    `out_at` (B,), out is (B, D, 1) at those positions (see `forward_out_at`)."""
    a = a._replace(save_checkpoints=False)
    out, last_state, _, states = _forward(a, at, out_at, patch=(positions, values))
    return out, last_state, states


def forward_out_at(a: ScanArgs, out_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, D, 1) at positions out_at (B,) of each row alone, last_state), without
    gradients: the contraction over N, the skip and the gate run at those positions only."""
    out, last_state, _, _ = _forward(a._replace(save_checkpoints=False), None, out_at)
    return out, last_state


def _forward(a: ScanArgs, at: torch.Tensor | None, out_at: torch.Tensor | None = None, patch=None):
    batch, channels, length = a.u.shape
    N = a.A.shape[1]
    T = chunk_length(batch, channels, N, length)
    pick = lambda x, rows: None if x is None else x[rows]  # noqa: E731
    # The states asked for, written by each tile into its rows (no concatenation after).
    states = None
    if at is not None:
        states = a.u.new_empty(*at.shape, channels, N, dtype=compute_dtype(a.u))
    parts = [
        _forward_rows(
            _rows_of(a, rows),
            T,
            pick(at, rows),
            pick(out_at, rows),
            None if patch is None else (patch[0][rows], patch[1][rows]),
            pick(states, rows),
        )
        for rows in _tiles(batch, channels, N, length)
    ]
    if len(parts) == 1:
        out, last_state, checkpoints, _ = parts[0]
    else:
        out = torch.cat([p[0] for p in parts])
        last_state = torch.cat([p[1] for p in parts])
        checkpoints = torch.cat([p[2] for p in parts], dim=1)
    if out_at is not None:  # (B, D, 1): no layout of u to match
        return out.to(a.u.dtype), last_state, checkpoints, states
    return match_layout(out, a.u, a.u.dtype), last_state, checkpoints, states


class _Chunked(NamedTuple):
    """One tile of rows in the compute dtype, laid out for the chunk loops (time-major)."""

    dt: torch.Tensor  # (B, D, L), softplus(pre) or pre
    pre: torch.Tensor  # (B, D, L), delta + delta_bias
    u: torch.Tensor  # (B, D, L)
    dt_t: torch.Tensor  # (L, B, D)
    u_t: torch.Tensor  # (L, B, D)
    A: torch.Tensor  # (D, N)
    B_t: torch.Tensor  # B in _time_major_bc's layout
    C_t: torch.Tensor  # C in _time_major_bc's layout


def _chunked(a: ScanArgs, compute: torch.dtype) -> _Chunked:
    pre = a.delta.to(compute)
    if a.delta_bias is not None:
        pre = pre + a.delta_bias.to(compute)[:, None]
    dt = F.softplus(pre) if a.softplus else pre
    u = a.u.to(compute)
    B_t, C_t = _time_major_bc(a.B.to(compute)), _time_major_bc(a.C.to(compute))
    return _Chunked(dt, pre, u, _time_major(dt), _time_major(u), a.A.to(compute), B_t, C_t)


def _forward_rows(
    args: ScanArgs,
    T: int,
    at: torch.Tensor | None = None,
    out_at: torch.Tensor | None = None,
    patch: tuple | None = None,
    picked: torch.Tensor | None = None,
):
    """`forward` for one tile of rows, in chunks of T positions; out in the compute dtype.
    `at`: (rows, P) positions whose states to return as a fourth output (else None);
    `out_at`: (rows,) the one position of each row whose output to form (out (rows, D, 1));
    `patch`: (positions (rows,), values (rows, D, N)), the state after each row's position
    replaced (see `forward_patched`); `picked`: where the states at `at` go, (rows, P, D, N)
    (given with `at`)."""
    compute = compute_dtype(args.u)
    u, B, C, D, z, save = args.u, args.B, args.C, args.D, args.z, args.save_checkpoints
    batch, channels, length = u.shape
    N = args.A.shape[1]
    x = _chunked(args, compute)
    dt_t, u_t, A_c, B_c, C_c, u_c = x.dt_t, x.u_t, x.A, x.B_t, x.C_t, x.u
    A_log2 = A_c * LOG2E

    n_chunks = (length + T - 1) // T
    checkpoints = u.new_empty(n_chunks if save else 0, batch, channels, N, dtype=compute)
    # The state entering the current chunk, None for zero; read, never written: the carry
    # between chunks goes through its own buffer.
    state = None if args.initial_state is None else args.initial_state.to(compute)
    carried = None
    y = u.new_empty(1 if out_at is not None else length, batch, channels, dtype=compute)
    a_buf, h_buf = _chunk_buffers(2, T, u, N, compute)
    patched_at = _patched_rows(patch, compute)
    for c in range(n_chunks):
        t0, t1 = c * T, min(length, (c + 1) * T)
        a, hs = a_buf[: t1 - t0], h_buf[: t1 - t0]
        if save:
            checkpoints[c].zero_() if state is None else checkpoints[c].copy_(state)
        replace = {t - t0: r for t, r in patched_at.items() if t0 <= t < t1}
        Bt, Ct = _chunk(B_c, t0, t1), _chunk(C_c, t0, t1)
        _scan_chunk(dt_t[t0:t1], u_t[t0:t1], A_log2, Bt, B, state, a, hs, replace)
        if out_at is None:
            y[t0:t1] = _inner(hs, Ct, C)
            for i, (rows, _, kept) in replace.items():  # the output at p: unpatched states
                C_i = Ct if Ct.dim() == 2 else Ct[i, rows][None]
                y[t0 + i, rows] = _inner(kept[None], C_i, C)[0]
        else:  # the rows whose output position lies in this chunk
            rows = ((out_at >= t0) & (out_at < t1)).nonzero()[:, 0]
            if len(rows):
                t = out_at[rows]
                C_at = C_c if C_c.dim() == 2 else C_c[t, rows][None]
                y[0, rows] = _inner(hs[t - t0, rows][None], C_at, C)[0]
            for i, (patched, _, kept) in replace.items():  # output and patch at one position
                same = (out_at[patched] == t0 + i).nonzero()[:, 0]
                if len(same):
                    C_i = Ct if Ct.dim() == 2 else Ct[i, patched[same]][None]
                    y[0, patched[same]] = _inner(kept[same][None], C_i, C)[0]
        if at is not None:  # the (row, j) pairs whose position lies in this chunk
            rows, j = ((at >= t0) & (at < t1)).nonzero(as_tuple=True)
            picked[rows, j] = hs[at[rows, j] - t0, rows]
        if c < n_chunks - 1:  # the buffers are overwritten by the next chunk
            carried = torch.empty_like(hs[-1]) if carried is None else carried
            state = carried.copy_(hs[-1])
    # (a chunk of one position is the last state itself: no copy, no larger buffer held)
    last_state = hs[-1] if hs.shape[0] == 1 else hs[-1].clone()

    if out_at is not None:  # (rows, D, 1) at each row's position
        rows = torch.arange(batch, device=u.device)
        out = y[0][..., None]
        if D is not None:
            out.addcmul_(D.to(compute)[:, None], u_c[rows, :, out_at][..., None])
        if z is not None:
            out.mul_(F.silu(z[rows, :, out_at].to(compute))[..., None])
        return out, last_state, checkpoints, picked
    out = _from_time_major_bdl(y, u)
    if D is not None:
        out.addcmul_(D.to(compute)[:, None], u_c)
    if z is not None:
        out.mul_(F.silu(z.to(compute)))
    return out, last_state, checkpoints, picked


def _patched_rows(patch: tuple | None, compute: torch.dtype) -> dict:
    """position -> (rows patched after it, their values, a buffer for their unpatched states)."""
    if patch is None:
        return {}
    positions, values = patch
    groups = {}
    for t in positions.unique().tolist():
        rows = (positions == t).nonzero()[:, 0]
        chosen = values[rows].to(compute)
        groups[t] = (rows, chosen, torch.empty_like(chosen))
    return groups


def _from_time_major_bdl(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(L, B, D) -> a new (B, D, L) tensor laid out like `like` (one transposing copy)."""
    out = torch.empty_like(like, dtype=x.dtype)
    return out.copy_(x.permute(1, 2, 0))


def backward(a: ScanArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state); None for absent
    inputs (kernels.selective_scan.torch_backward)."""
    from kernels.selective_scan.torch_backward import backward as run

    return run(a, grads, saved)
