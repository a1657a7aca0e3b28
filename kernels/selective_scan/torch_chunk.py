"""One chunk of the selective scan's PyTorch path, shared by its forward (torch_path.py) and its
backward (torch_backward.py): the inputs laid out time-major, the in-chunk recurrence, and the
contractions of a chunk's (T, B, D, N) states with B or C.

B and C come in three layouts. `time_major_bc` lays one out with positions first (once per
call: strided reads of B or C inside the chunk loop are several times slower), `chunk_of` cuts
positions [t0, t1) out of that, and `outer`, `inner` broadcast or contract a chunk against the
states without materialising a per-channel copy of it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mecheval_kernels.selective_scan.op import ScanArgs

LOG2E = math.log2(math.e)


def time_major_bc(X: torch.Tensor) -> torch.Tensor:
    if X.dim() == 2:  # (D, N): the same at every position
        return X
    if X.dim() == 3:  # (B, N, L) -> (L, B, N)
        return X.permute(2, 0, 1).contiguous()
    return X.permute(3, 0, 1, 2).contiguous()  # (B, G, N, L) -> (L, B, G, N)


def chunk_of(Xt: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    return Xt if Xt.dim() == 2 else Xt[t0:t1]


def sum_last(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1) as a matrix-vector product (a short last dimension sums slowly)."""
    ones = x.new_ones(x.shape[-1])
    return (x.reshape(-1, x.shape[-1]) @ ones).view(x.shape[:-1])


def outer(w: torch.Tensor, Xc: torch.Tensor, X: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
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


def inner(states: torch.Tensor, Xc: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """sum_n states * X: (T, B, D). For a (B, N, L) X, one batched (D, N) x (N, 1) product per
    position and row (reads the states once: on CPU with torch 2.13, 5-10% off a whole scan
    against a multiply into a buffer and a matrix-vector product)."""
    if X.dim() == 2:
        return sum_last(states * Xc)
    if X.dim() == 3:
        return (states @ Xc[..., None]).squeeze(-1)
    T, batch, channels, N = states.shape
    groups = Xc.shape[2]
    per_group = states.reshape(T, batch, groups, channels // groups, N) @ Xc[..., None]
    return per_group.reshape(T, batch, channels)


def time_major(x: torch.Tensor) -> torch.Tensor:
    """(B, D, L) -> contiguous (L, B, D)."""
    return x.permute(2, 0, 1).contiguous()


def scan_chunk(
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
    outer(dt * u, Bc, B, h)  # dt * B * u, turned into the states in place
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


def chunk_buffers(count: int, T: int, like: torch.Tensor, N: int, compute: torch.dtype):
    batch, channels, _ = like.shape
    return [like.new_empty(T, batch, channels, N, dtype=compute) for _ in range(count)]


class ChunkInputs(NamedTuple):
    """One tile of rows in the compute dtype, laid out for the chunk loops (time-major)."""

    dt: torch.Tensor  # (B, D, L), softplus(pre) or pre
    pre: torch.Tensor  # (B, D, L), delta + delta_bias
    u: torch.Tensor  # (B, D, L)
    dt_t: torch.Tensor  # (L, B, D)
    u_t: torch.Tensor  # (L, B, D)
    A: torch.Tensor  # (D, N)
    B_t: torch.Tensor  # B in time_major_bc's layout
    C_t: torch.Tensor  # C in time_major_bc's layout


def chunk_inputs(a: ScanArgs, compute: torch.dtype) -> ChunkInputs:
    pre = a.delta.to(compute)
    if a.delta_bias is not None:
        pre = pre + a.delta_bias.to(compute)[:, None]
    dt = F.softplus(pre) if a.softplus else pre
    u = a.u.to(compute)
    B_t, C_t = time_major_bc(a.B.to(compute)), time_major_bc(a.C.to(compute))
    return ChunkInputs(dt, pre, u, time_major(dt), time_major(u), a.A.to(compute), B_t, C_t)


def from_time_major_bdl(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(L, B, D) -> a new (B, D, L) tensor laid out like `like` (one transposing copy)."""
    out = torch.empty_like(like, dtype=x.dtype)
    return out.copy_(x.permute(1, 2, 0))
