"""The PyTorch path of the delta rule (CPU fast path): the chunked WY form in batched matmuls.

Within a chunk of C steps starting from state S (rows Q, K, V, beta; Kb = diag(beta) K), the
per-step recurrence unrolls to

    A = (I + tril(Kb K^T, -1))^{-1}                 (one triangular solve for all chunks)
    U = A diag(beta) V - A Kb S                     (the chunk's u_t rows)
    O = Q S + tril(Q K^T) U                         (q pre-scaled; tril keeps the diagonal)
    S' = S + K^T U

so only U and S' are left to the sequential loop over chunks (T / C steps of matmuls instead of
T steps of matrix-vector products); O is one batched matmul over all chunks afterwards. The
sequence is zero-padded to a multiple of C (padded steps have k = 0 and beta = 0, so they leave
the state alone).

The backward is written out (the derivative of the above, as in the Triton kernels): a reverse
loop over chunks for the state's gradient dS and dR = A^T dU, then batched matmuls over all
chunks for the gradients of q, k, v and beta. The forward saves the chunk start states, the U
rows and A for it: no per-step state is ever kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._op import compute_dtype
from kernels.delta_rule.op import DeltaArgs

# Steps per chunk: the sequential loop then runs T / 64 steps of (64, K) x (K, V) matmuls.
# Sequences shorter than this are one chunk of their own length.
CHUNK_SIZE = 64


def _chunking(T: int) -> tuple[int, int]:
    chunk = min(CHUNK_SIZE, T)
    return chunk, -(-T // chunk)


def _to_chunks(x: torch.Tensor, chunk: int, num_chunks: int) -> torch.Tensor:
    """(B, T, H, D) -> (num_chunks, B, H, chunk, D), zero-padded along T, contiguous (so that
    each chunk's slice, used in the sequential loops, is one dense block)."""
    B, T, H, D = x.shape
    pad = num_chunks * chunk - T
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
    return x.reshape(B, num_chunks, chunk, H, D).permute(1, 0, 3, 2, 4).contiguous()


def _from_chunks(x: torch.Tensor, T: int) -> torch.Tensor:
    """(num_chunks, B, H, chunk, D) -> (B, T, H, D)."""
    n, B, H, C, D = x.shape
    return x.permute(1, 0, 3, 2, 4).reshape(B, n * C, H, D)[:, :T]


def empty_saved(
    q: torch.Tensor, v: torch.Tensor, kernel: str = "chunked", states: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The forward's saved buffers, unfilled: U rows (n, B, H, C, V), chunk start states
    (n, B, H, K, V; None without `states`) and A (n, B, H, C, C), in float32 (float64 for
    float64 inputs)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    chunk, n = _chunking(T)
    dtype = compute_dtype(q)
    return (
        q.new_empty(n, B, H, chunk, V, dtype=dtype),
        q.new_empty(n, B, H, K, V, dtype=dtype) if states else None,
        q.new_empty(n, B, H, chunk, chunk, dtype=dtype),
    )


def _chunked_inputs(a: DeltaArgs):
    compute = compute_dtype(a.q)
    chunk, n = _chunking(a.q.shape[1])
    qc = _to_chunks(a.q.to(compute) * a.scale, chunk, n)  # (n, B, H, C, K), pre-scaled
    kc = _to_chunks(a.k.to(compute), chunk, n)
    vc = _to_chunks(a.v.to(compute), chunk, n)
    bc = _to_chunks(a.beta.to(compute).unsqueeze(-1), chunk, n)  # (n, B, H, C, 1)
    return qc, kc, vc, bc


def forward(args: DeltaArgs) -> tuple[torch.Tensor, ...]:
    """o (B, T, H, V) in q's dtype (contiguous), the final state (B, H, K, V) in float32
    (float64 for float64 inputs) or None, and the buffers the backward needs (`empty_saved`).
    The PyTorch path has one kernel: `args.kernel` is ignored.
    """
    qc, kc, u, h, a, state = _recurrence(args)
    o = qc @ h + (qc @ kc.transpose(-1, -2)).tril() @ u  # (n, B, H, C, V)
    o = _from_chunks(o, args.q.shape[1]).to(args.q.dtype).contiguous()
    return o, (state if args.output_final_state else None), u, h, a


def forward_inference(args: DeltaArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, the final state or None) as `forward`, when no backward will run: the chunks'
    start states are not copied into a saved buffer (a zero one is left out)."""
    qc, kc, u, starts, _, state = _recurrence(args, save=False)
    o = (qc @ kc.transpose(-1, -2)).tril() @ u  # (n, B, H, C, V)
    h = _stacked(starts)
    if h is not None:
        o += qc @ h
    o = _from_chunks(o, args.q.shape[1]).to(args.q.dtype).contiguous()
    return o, (state if args.output_final_state else None)


def forward_out_at(args: DeltaArgs, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(o (B, 1, H, V) at step at[b] of each row b alone, the final state or None), without
    gradients: o_t = S_t^T q_t with S_t the chunk's start state plus its writes up to t. The
    chunks' start states are kept as they run, not copied into a buffer (None: zero)."""
    qc, kc, u, starts, _, state = _recurrence(args, save=False)
    chunk, rows = qc.shape[3], torch.arange(len(at), device=at.device)
    c, j = at // chunk, at % chunk
    pick = (lambda x: x[0]) if qc.shape[0] == 1 else (lambda x: x[c, rows])  # noqa: E731
    q_at = pick(qc)[rows, :, j][:, :, None]  # (B, H, 1, K)
    scores = q_at @ pick(kc).transpose(-1, -2)  # (B, H, 1, C)
    later = torch.arange(chunk, device=at.device) > j[:, None]  # (B, C): written after t
    o = scores.masked_fill(later[:, None, None, :], 0.0) @ pick(u)  # (B, H, 1, V)
    h = _stacked(starts)
    if h is not None:
        o = o + q_at @ pick(h)
    return o.transpose(1, 2).to(args.q.dtype), (state if args.output_final_state else None)


def _stacked(starts: list) -> torch.Tensor | None:
    """The chunks' start states as one (n, B, H, K, V) tensor (a view for one chunk), None
    for a single zero one; only the first chunk's start may be zero (None)."""
    if len(starts) == 1:
        return None if starts[0] is None else starts[0][None]
    first = torch.zeros_like(starts[1]) if starts[0] is None else starts[0]
    return torch.stack([first, *starts[1:]])


def _recurrence(args: DeltaArgs, save: bool = True) -> tuple[torch.Tensor, ...]:
    """The chunked recurrence: (q pre-scaled, k, u, the chunks' start states h, A, the state
    after the last chunk: only when `output_final_state`, else the last chunk's start).
    Without `save` (no backward will run), h is the list of start states as they ran, None
    for a zero one."""
    q, initial_state = args.q, args.initial_state
    B, T, H, K = q.shape
    qc, kc, vc, bc = _chunked_inputs(args)
    u, h, a = empty_saved(q, args.v, states=save)
    kb = kc * bc
    lower = (kb @ kc.transpose(-1, -2)).tril(-1)
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    torch.linalg.solve_triangular(
        eye + lower, eye.expand_as(lower), upper=False, unitriangular=True, out=a
    )
    w_k, w_v = a @ kb, a @ (vc * bc)
    state = None if initial_state is None else initial_state.to(u.dtype)
    starts = []
    for c in range(u.shape[0]):
        if save:
            h[c] = 0 if state is None else state
        starts.append(state)
        if state is None:  # a zero state: nothing to subtract
            u[c] = w_v[c]
        else:
            torch.sub(w_v[c], w_k[c] @ state, out=u[c])
        if c + 1 < u.shape[0] or args.output_final_state:  # the last write only for them
            write = kc[c].transpose(-1, -2) @ u[c]
            state = write if state is None else state + write
    return qc, kc, u, (h if save else starts), a, state


# Up to this many positions per row, their states are formed one by one (a masked matmul
# each); more, and every state of the sequence is formed (a cumulative sum) and picked from.
FEW_POSITIONS = 4


def forward_states_at(args: DeltaArgs, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(o, the final state (None unless `output_final_state`), the states after steps
    at[b, :] of each row b (B, P, H, K, V) in the compute dtype), without gradients. Inside a
    chunk the state after step j is the chunk's start state plus K[:j+1]^T U[:j+1], the
    chunk's rank-one writes up to j."""
    o, final, u, h, _ = forward(args)
    T = args.q.shape[1]
    chunk, n = _chunking(T)
    kc = _to_chunks(args.k.to(h.dtype), chunk, n)  # (n, B, H, C, K)
    B, P = at.shape
    rows = torch.arange(B, device=at.device)[:, None]
    if P > FEW_POSITIONS:
        # The running sum over the chunk's steps, one in-place add per step (cumsum over a
        # middle axis is about 5x slower on CPU).
        states = kc[..., :, None] * u[..., None, :]  # (n, B, H, C, K, V)
        states[:, :, :, 0] += h
        for j in range(1, chunk):
            states[:, :, :, j] += states[:, :, :, j - 1]
        H, K, V = h.shape[2:]
        states = states.permute(1, 0, 3, 2, 4, 5).reshape(B, n * chunk, H, K, V)
        return o, final, states[rows, at]
    c, j = at // chunk, at % chunk  # (B, P): each position's chunk and step in it
    written = torch.arange(chunk, device=at.device) <= j[..., None]  # (B, P, C)
    keys = kc[c, rows] * written[:, :, None, :, None].to(h.dtype)  # (B, P, H, C, K)
    return o, final, h[c, rows] + keys.transpose(-1, -2) @ u[c, rows]


def backward(args: DeltaArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (dq, dk, dv, dbeta, dinitial_state) in the compute dtype; None for an absent
    initial_state."""
    do = grads[0]
    dfinal = grads[1] if args.output_final_state else None
    T, scale = args.q.shape[1], args.scale
    u, h, a = saved
    qc, kc, vc, bc = _chunked_inputs(args)
    chunk, n = _chunking(T)
    doc = _to_chunks(do.to(h.dtype), chunk, n)
    kb = kc * bc
    qk_t = (qc @ kc.transpose(-1, -2)).tril().transpose(-1, -2)
    dstate = h.new_zeros(h.shape[1:]) if dfinal is None else dfinal.to(h.dtype)
    dh = torch.empty_like(h)  # gradient of each chunk's end state
    dr = torch.empty_like(u)  # gradient of R = diag(beta) V - Kb S
    for c in reversed(range(n)):
        dh[c] = dstate
        du = kc[c] @ dstate + qk_t[c] @ doc[c]
        torch.matmul(a[c].transpose(-1, -2), du, out=dr[c])
        dstate = dstate + qc[c].transpose(-1, -2) @ doc[c] - kb[c].transpose(-1, -2) @ dr[c]
    # Everything else is parallel over chunks.
    d_qk = (doc @ u.transpose(-1, -2)).tril()  # gradient of tril(Q K^T)
    d_lower = -(dr @ u.transpose(-1, -2)).tril(-1)  # gradient of tril(Kb K^T, -1)
    d_kb = d_lower @ kc - dr @ h.transpose(-1, -2)
    dq = (doc @ h.transpose(-1, -2) + d_qk @ kc) * scale
    dk = (
        u @ dh.transpose(-1, -2)
        + d_qk.transpose(-1, -2) @ qc
        + d_lower.transpose(-1, -2) @ kb
        + bc * d_kb
    )
    dv = bc * dr
    dbeta = (d_kb * kc).sum(-1, keepdim=True) + (dr * vc).sum(-1, keepdim=True)
    return [
        _from_chunks(dq, T),
        _from_chunks(dk, T),
        _from_chunks(dv, T),
        _from_chunks(dbeta, T).squeeze(-1),
        None if args.initial_state is None else dstate,
    ]
