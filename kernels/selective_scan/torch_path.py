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
gradient from the two (one tile of rows: mecheval_kernels.selective_scan.torch_backward). Autograd
through the per-position loop would record every step and is orders of magnitude slower (see
docs/kernels.md). What one chunk does, forward and backward alike, is in torch_chunk.py; this
module sizes the tiles and chunks and runs them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mecheval_kernels._op import compute_dtype
from mecheval_kernels.layout import match_layout
from mecheval_kernels.selective_scan import torch_chunk
from mecheval_kernels.selective_scan.op import ScanArgs
from mecheval_kernels.selective_scan.torch_backward import backward_rows

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
    x = torch_chunk.chunk_inputs(args, compute)
    dt_t, u_t, A_c, B_c, C_c, u_c = x.dt_t, x.u_t, x.A, x.B_t, x.C_t, x.u
    A_log2 = A_c * torch_chunk.LOG2E

    n_chunks = (length + T - 1) // T
    checkpoints = u.new_empty(n_chunks if save else 0, batch, channels, N, dtype=compute)
    # The state entering the current chunk, None for zero; read, never written: the carry
    # between chunks goes through its own buffer.
    state = None if args.initial_state is None else args.initial_state.to(compute)
    carried = None
    y = u.new_empty(1 if out_at is not None else length, batch, channels, dtype=compute)
    a_buf, h_buf = torch_chunk.chunk_buffers(2, T, u, N, compute)
    patched_at = _patched_rows(patch, compute)
    for c in range(n_chunks):
        t0, t1 = c * T, min(length, (c + 1) * T)
        a, hs = a_buf[: t1 - t0], h_buf[: t1 - t0]
        if save:
            checkpoints[c].zero_() if state is None else checkpoints[c].copy_(state)
        replace = {t - t0: r for t, r in patched_at.items() if t0 <= t < t1}
        Bt, Ct = torch_chunk.chunk_of(B_c, t0, t1), torch_chunk.chunk_of(C_c, t0, t1)
        torch_chunk.scan_chunk(dt_t[t0:t1], u_t[t0:t1], A_log2, Bt, B, state, a, hs, replace)
        if out_at is None:
            y[t0:t1] = torch_chunk.inner(hs, Ct, C)
            for i, (rows, _, kept) in replace.items():  # the output at p: unpatched states
                C_i = Ct if Ct.dim() == 2 else Ct[i, rows][None]
                y[t0 + i, rows] = torch_chunk.inner(kept[None], C_i, C)[0]
        else:  # the rows whose output position lies in this chunk
            rows = ((out_at >= t0) & (out_at < t1)).nonzero()[:, 0]
            if len(rows):
                t = out_at[rows]
                C_at = C_c if C_c.dim() == 2 else C_c[t, rows][None]
                y[0, rows] = torch_chunk.inner(hs[t - t0, rows][None], C_at, C)[0]
            for i, (patched, _, kept) in replace.items():  # output and patch at one position
                same = (out_at[patched] == t0 + i).nonzero()[:, 0]
                if len(same):
                    C_i = Ct if Ct.dim() == 2 else Ct[i, patched[same]][None]
                    y[0, patched[same]] = torch_chunk.inner(kept[same][None], C_i, C)[0]
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
    out = torch_chunk.from_time_major_bdl(y, u)
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


def backward(a: ScanArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, dinitial_state); None for absent
    inputs. Tiles of rows run one after another (`backward_rows`) and the gradients of shared
    inputs are summed in tile order (deterministic)."""
    (dout, dlast), (checkpoints,) = grads, saved
    batch, channels, length = a.u.shape
    N = a.A.shape[1]
    T = chunk_length(batch, channels, N, length)
    parts = []
    for rows in _tiles(batch, channels, N, length):
        dlast_rows = None if dlast is None else dlast[rows]
        parts.append(
            backward_rows(_rows_of(a, rows), dout[rows], dlast_rows, checkpoints[:, rows], T)
        )
    result = []
    for i, name in enumerate(ScanArgs._fields[:9]):  # the tensors
        x, tile_grads = getattr(a, name), [p[i] for p in parts]
        time_major = name in ("B", "C")  # rows on axis 1 when per row
        if x is None:
            g = None
        elif _per_row(name, x):
            g = torch.cat(tile_grads, dim=int(time_major))
        else:
            g = _sum_in_order(tile_grads)
        result.append(_from_time_major(g, x) if time_major else g)
    return result


def _sum_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone() if len(parts) > 1 else parts[0]
    for part in parts[1:]:
        total += part
    return total


def _from_time_major(x: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """A gradient gathered time-major ((D, N), (L, B, N) or (L, B, G, N)) in X's axis order."""
    if X.dim() == 3:
        return x.permute(1, 2, 0)
    if X.dim() == 4:
        return x.permute(1, 2, 3, 0)
    return x
