"""The PyTorch path of the gated delta rule (CPU fast path): the chunked WY form in batched
matmuls, the delta rule's (kernels/delta_rule/torch_path.py) with the decays folded in.

Within a chunk of C steps starting from state S (rows Q (pre-scaled), K, V, beta; Kb =
diag(beta) K), let G_i = g_1 + ... + g_i (the chunk's cumulative log decay), e_i = exp(G_i),
w_i = exp(G_C - G_i) (G_C the chunk's total) and Gamma[i, j] = exp(G_i - G_j) for j <= i (zero
above the diagonal). Differences of G are never formed: they are the segment sums
g_{j+1} + ... + g_i, summed directly (a masked cumulative sum), because with large decays
(|G| ~ 1e4) G_i - G_j in float32 loses every digit; and with g <= 0 no exp of a positive number
is taken. The per-step recurrence unrolls to

    L = tril(Kb K^T, -1) * Gamma ;  A = (I + L)^{-1}    (one triangular solve for all chunks)
    U = A (diag(beta) V - diag(e) Kb S)                 (the chunk's u_t rows)
    O = diag(e) Q S + (tril(Q K^T) * Gamma) U
    S' = e_C S + (diag(w) K)^T U

so only U and S' are left to the sequential loop over chunks. The sequence is zero-padded to a
multiple of C (padded steps have k = 0, beta = 0 and g = 0: they leave the state alone).

The backward is written out (the derivative of the above, as in the Triton kernels): a reverse
loop over chunks for the state's gradient and dR = A^T dU, then batched matmuls over all chunks
for the gradients of q, k, v, beta and of the cumulative decays G, whose reverse cumulative sum
within each chunk is g's gradient. The forward saves the chunk start states, the U rows and A:
no per-step state is ever kept.

Non-finite inputs stay causal, as in the per-step recurrence. Inside a chunk the masked
products multiply the later steps' rows by zeros, and 0 * NaN is NaN: a NaN at step t would
reach the outputs before t. So the forward runs on the inputs with every non-finite entry set
to zero, and then marks non-finite what the recurrence makes non-finite: from step t on, every
output of the row and head for a non-finite k, g or beta at t (the whole state), only output
column c for a non-finite v[..., c] (state column c), and the output at t alone for a
non-finite q at t. Finite inputs give exactly what they gave without this.
"""

from __future__ import annotations

import torch

from kernels._op import compute_dtype
from kernels.delta_rule.torch_path import _from_chunks, _to_chunks
from kernels.gated_delta_rule.op import GatedDeltaArgs

# Sequences shorter than the delta rule's CHUNK_SIZE are one chunk of their own length.
CHUNK_SIZE = 64


def _chunks(T: int) -> tuple[int, int]:
    chunk = min(CHUNK_SIZE, T)
    return chunk, -(-T // chunk)


def empty_saved(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The forward's saved buffers, unfilled: U rows (n, B, H, C, V), chunk start states
    (n, B, H, K, V) and A (n, B, H, C, C), in float32 (float64 for float64 inputs)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    chunk, n = _chunks(T)
    dtype = compute_dtype(q)
    return (
        q.new_empty(n, B, H, chunk, V, dtype=dtype),
        q.new_empty(n, B, H, K, V, dtype=dtype),
        q.new_empty(n, B, H, chunk, chunk, dtype=dtype),
    )


def _chunked_inputs(a: GatedDeltaArgs):
    compute = compute_dtype(a.q)
    chunk, n = _chunks(a.q.shape[1])
    qc = _to_chunks(a.q.to(compute) * a.scale, chunk, n)  # (n, B, H, C, K), pre-scaled
    kc = _to_chunks(a.k.to(compute), chunk, n)
    vc = _to_chunks(a.v.to(compute), chunk, n)
    bc = _to_chunks(a.beta.to(compute).unsqueeze(-1), chunk, n)  # (n, B, H, C, 1)
    gc = _to_chunks(a.g.to(compute).unsqueeze(-1), chunk, n)  # (n, B, H, C, 1)
    return qc, kc, vc, bc, gc


def _decays(gc: torch.Tensor):
    """From the chunks' g (n, B, H, C, 1): e = exp(G), w = exp(G_C - G) (both
    (n, B, H, C, 1)), e_C (n, B, H, 1, 1) and Gamma (n, B, H, C, C), zero above the diagonal."""
    C = gc.shape[3]
    ones = torch.ones(C, C, dtype=torch.bool, device=gc.device)
    # seg[i, j] = g_{j+1} + ... + g_i: each column summed from zero, never G_i - G_j.
    seg = (gc * ones.tril(-1)).cumsum(-2)  # gc * mask: [l, j] = g_l for l > j
    gamma = seg.exp() * ones.tril()
    G = gc.cumsum(3)
    return G.exp(), seg[..., -1, :].unsqueeze(-1).exp(), G[..., -1:, :].exp(), gamma


def _all_finite(args: GatedDeltaArgs) -> bool:
    """Whether every input is known to be finite, so that `_NonFinite`'s passes over them can
    be skipped: one sum per tensor, read on CPU only (on a GPU the read would be a sync, which
    a CUDA graph's capture refuses). A sum of finite values that overflows only sends them down
    the exact, slower way."""
    if args.q.device.type != "cpu":
        return False
    tensors = [args.q, args.k, args.v, args.g, args.beta, args.initial_state]
    sums = torch.stack([t.sum(dtype=torch.float32) for t in tensors if t is not None])
    return bool(torch.isfinite(sums).all())


class _NonFinite:
    """Where the recurrence's outputs and states are non-finite, from where its inputs are (see
    the module docstring); `finite` holds the inputs with each non-finite entry set to zero."""

    def __init__(self, args: GatedDeltaArgs) -> None:
        def zeroed(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            bad = ~torch.isfinite(t)
            return t.masked_fill(bad, 0), bad

        (q, bad_q), (k, bad_k), (v, bad_v) = zeroed(args.q), zeroed(args.k), zeroed(args.v)
        (g, bad_g), (beta, bad_beta) = zeroed(args.g), zeroed(args.beta)
        whole = bad_k.any(-1) | bad_g | bad_beta  # (B, T, H): every state column
        written = whole[..., None] | bad_v  # (B, T, H, V): the state columns made non-finite
        initial = args.initial_state
        if initial is not None:
            initial, bad_initial = zeroed(initial)
            written[:, 0] |= bad_initial.any(-2)
        self.state_columns = written.cummax(dim=1).values  # (B, T, H, V), from t on
        self.outputs = self.state_columns | bad_q.any(-1, keepdim=True)
        self.finite = args._replace(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        return o.masked_fill(self.outputs, torch.nan)

    def final_state(self, state: torch.Tensor | None) -> torch.Tensor | None:
        """The state after the last step, (B, H, K, V)."""
        if state is None:
            return None
        return state.masked_fill(self.state_columns[:, -1, :, None, :], torch.nan)

    def states_at(self, states: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        """The states after steps at (B, P): (B, P, H, K, V)."""
        rows = torch.arange(at.shape[0], device=at.device)[:, None]
        return states.masked_fill(self.state_columns[rows, at][..., None, :], torch.nan)


def forward(args: GatedDeltaArgs) -> tuple[torch.Tensor, ...]:
    """o (B, T, H, V) in q's dtype (contiguous), the final state (B, H, K, V) in float32
    (float64 for float64 inputs) or None, and the buffers the backward needs (`empty_saved`).
    """
    if _all_finite(args):
        return _forward(args)
    nonfinite = _NonFinite(args)
    o, final, *saved = _forward(nonfinite.finite)
    return nonfinite.output(o), nonfinite.final_state(final), *saved


def _forward(args: GatedDeltaArgs) -> tuple[torch.Tensor, ...]:
    """`forward` on finite inputs."""
    q, initial_state = args.q, args.initial_state
    T = q.shape[1]
    qc, kc, vc, bc, gc = _chunked_inputs(args)
    u, h, a = empty_saved(q, args.v)
    e, w, e_last, gamma = _decays(gc)
    kb = kc * bc
    lower = (kb @ kc.transpose(-1, -2)) * gamma.tril(-1)
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    torch.linalg.solve_triangular(
        eye + lower, eye.expand_as(lower), upper=False, unitriangular=True, out=a
    )
    w_k, w_v = a @ (kb * e), a @ (vc * bc)
    kw = kc * w
    state = h.new_zeros(h.shape[1:]) if initial_state is None else initial_state.to(h.dtype)
    for c in range(h.shape[0]):
        h[c] = state
        torch.sub(w_v[c], w_k[c] @ state, out=u[c])
        state = e_last[c] * state + kw[c].transpose(-1, -2) @ u[c]
    o = (qc * e) @ h + ((qc @ kc.transpose(-1, -2)) * gamma) @ u  # (n, B, H, C, V)
    o = _from_chunks(o, T).to(q.dtype).contiguous()
    return o, (state if args.output_final_state else None), u, h, a


def forward_states_at(args: GatedDeltaArgs, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(o, the final state, the states after steps at[b, :] of each row b (B, P, H, K, V) in the
    compute dtype), without gradients. Inside a chunk the state after step j is
    e_j S + sum_{i <= j} Gamma[j, i] k_i u_i^T, from the chunk's start state S."""
    nonfinite = None if _all_finite(args) else _NonFinite(args)
    args = args._replace(output_final_state=True)
    if nonfinite is not None:
        args = nonfinite.finite._replace(output_final_state=True)
    o, final, u, h, _ = _forward(args)
    _, kc, _, _, gc = _chunked_inputs(args)
    e, _, _, gamma = _decays(gc)
    rows = torch.arange(at.shape[0], device=at.device)[:, None]
    chunk = kc.shape[3]
    c, j = at // chunk, at % chunk  # (B, P): each position's chunk and step in it
    weights = gamma[c, rows, :, j]  # (B, P, H, C): Gamma[j, i], zero for i > j
    keys = kc[c, rows] * weights[..., None]  # (B, P, H, C, K)
    start = e[c, rows, :, j, None] * h[c, rows]  # e[c, rows, :, j]: (B, P, H, 1)
    states = start + keys.transpose(-1, -2) @ u[c, rows]
    if nonfinite is None:
        return o, final, states
    return nonfinite.output(o), nonfinite.final_state(final), nonfinite.states_at(states, at)


def forward_inference(args: GatedDeltaArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, the final state or None) as `forward`, when no backward will run."""
    return forward(args)[:2]


def forward_out_at(args: GatedDeltaArgs, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(o (B, 1, H, V) at step at[b] of each row b, the final state or None), without
    gradients (picked from the whole output: its one batched product is a small part of
    the pass)."""
    o, final = forward_inference(args)
    return o[torch.arange(len(at), device=at.device), at][:, None], final


def _row_minus_column(x: torch.Tensor) -> torch.Tensor:
    """For a (.., C, C) gradient-times-value matrix of entries that depend on G_i - G_j: the
    gradient of each G, (.., C, 1)."""
    return x.sum(-1, keepdim=True) - x.sum(-2).unsqueeze(-1)


def backward(args: GatedDeltaArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (dq, dk, dv, dg, dbeta, dinitial_state) in the compute dtype; None for an
    absent initial_state."""
    do = grads[0]
    dfinal = grads[1] if args.output_final_state else None
    T, scale = args.q.shape[1], args.scale
    u, h, a = saved
    qc, kc, vc, bc, gc = _chunked_inputs(args)
    chunk, n = _chunks(T)
    doc = _to_chunks(do.to(h.dtype), chunk, n)
    e, w, e_last, gamma = _decays(gc)
    kb = kc * bc
    p = (qc @ kc.transpose(-1, -2)) * gamma  # (tril(Q K^T) * Gamma)
    p_t, kw, kbe, qe = p.transpose(-1, -2), kc * w, kb * e, qc * e
    dstate = h.new_zeros(h.shape[1:]) if dfinal is None else dfinal.to(h.dtype)
    dh = torch.empty_like(h)  # gradient of each chunk's end state
    dr = torch.empty_like(u)  # gradient of R = diag(beta) V - diag(e) Kb S
    for c in reversed(range(n)):
        dh[c] = dstate
        du = p_t[c] @ doc[c] + kw[c] @ dstate
        torch.matmul(a[c].transpose(-1, -2), du, out=dr[c])
        dstate = (
            e_last[c] * dstate + qe[c].transpose(-1, -2) @ doc[c] - kbe[c].transpose(-1, -2) @ dr[c]
        )
    # Everything else is parallel over chunks.
    d_p = (doc @ u.transpose(-1, -2)).tril()  # gradient of P = tril(Q K^T) * Gamma
    d_lower = -(dr @ u.transpose(-1, -2)).tril(-1)  # gradient of L
    d_qk = d_p * gamma  # gradient of Q K^T
    d_kbk = d_lower * gamma  # gradient of Kb K^T
    do_h = doc @ h.transpose(-1, -2)  # (n, B, H, C, K)
    dr_h = dr @ h.transpose(-1, -2)
    u_dh = u @ dh.transpose(-1, -2)
    d_kb = d_kbk @ kc - e * dr_h
    dq = (e * do_h + d_qk @ kc) * scale
    dk = d_qk.transpose(-1, -2) @ qc + d_kbk.transpose(-1, -2) @ kb + bc * d_kb + w * u_dh
    dv = bc * dr
    dbeta = (d_kb * kc).sum(-1, keepdim=True) + (dr * vc).sum(-1, keepdim=True)
    # Gradient of each G_i: through e (O, R), Gamma (P, L) and w, e_C (S').
    lower = (kb @ kc.transpose(-1, -2)) * gamma.tril(-1)
    through_w = w * (kc * u_dh).sum(-1, keepdim=True)
    dG = (
        e * (qc * do_h).sum(-1, keepdim=True)
        + _row_minus_column(d_p * p)
        + _row_minus_column(d_lower * lower)
        - e * (kb * dr_h).sum(-1, keepdim=True)
        - through_w
    )
    dG[..., -1, :] += (e_last * (h * dh).sum((-1, -2), keepdim=True)).squeeze(-1)
    dG[..., -1, :] += through_w.sum(-2)
    dg = dG.flip(3).cumsum(3).flip(3)  # G_i = g_1 + ... + g_i
    return [
        _from_chunks(dq, T),
        _from_chunks(dk, T),
        _from_chunks(dv, T),
        _from_chunks(dg, T).squeeze(-1),
        _from_chunks(dbeta, T).squeeze(-1),
        None if args.initial_state is None else dstate,
    ]
