"""The PyTorch path of the delta-rule family (CPU fast path): the chunked WY form in batched
matmuls, the gate (the gated delta rule's log decays g, one per head or, KDA, one per key
channel) optional, and Comba's recall key p.

Within a chunk of C steps starting from state S (rows Q (pre-scaled), K, V, beta; Kb =
diag(beta) K), let G_i = g_1 + ... + g_i (the chunk's cumulative log decay), e_i = exp(G_i),
w_i = exp(G_C - G_i) (G_C the chunk's total) and Gamma[i, j] = exp(G_i - G_j) for j <= i (zero
above the diagonal). The per-step recurrence unrolls to

    L = tril(Kb K^T, -1) * Gamma ;  A = (I + L)^{-1}    (one triangular solve for all chunks)
    U = A (diag(beta) V - diag(e) Kb S)                 (the chunk's u_t rows)
    O = diag(e) Q S + (tril(Q K^T) * Gamma) U
    S' = e_C S + (diag(w) K)^T U

so only U and S' are left to the sequential loop over chunks (T / C steps of matmuls instead of
T steps of matrix-vector products); O is one batched matmul over all chunks afterwards.

With a decay per key channel (KDA) G_i, e_i, w_i are (K,) vectors, diag(e) X means X's rows
scaled channel by channel, and Gamma[i, j] is a (K,) vector too. While every chunk's decays are
moderate (no channel's total below -SAFE_DECAY) Gamma[i, j] is exp(G_i) exp(-G_j) and the
products with it are matmuls of rows scaled by those two factors (`Factored`); otherwise they
are sums over K of q_i k_j Gamma[i, j], formed as (C, C, K) tensors (hence KDA's shorter
chunks, `KEY_CHUNK_SIZE`). e_C S scales S's rows. Comba recalls with p before the step's decay:
in L and R, Kb becomes Pb = diag(beta) P, Gamma[i, j] becomes exp(G_{i-1} - G_j) and e_i
becomes exp(G_{i-1}) (`Decays.gamma_r`, `e_r`). Without a gate (the delta rule) every decay is
1 and Gamma the lower triangle of ones: the products with them are skipped (`Decays` is None).
Outside the factored form, differences of G are never formed: they are the segment sums
g_{j+1} + ... + g_i, summed directly (a masked cumulative sum), because with large decays
(|G| ~ 1e4) G_i - G_j in float32 loses every digit; and with g <= 0 no exp of a positive
number is taken. The sequence is zero-padded to a multiple of C (padded steps have k = 0,
beta = 0 and g = 0: they leave the state alone).

The backward is written out (the derivative of the above, as in the Triton kernels): a reverse
loop over chunks for the state's gradient and dR = A^T dU, then batched matmuls over all chunks
for the gradients of q, k, v, beta and, gated, of the cumulative decays G, whose reverse
cumulative sum within each chunk is g's gradient. The forward saves the chunk start states, the
U rows and A: no per-step state is ever kept.

Non-finite inputs stay causal, as in the per-step recurrence
(mecheval_kernels.delta_rule.nonfinite).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mecheval_kernels._op import compute_dtype
from mecheval_kernels.delta_rule import nonfinite
from mecheval_kernels.delta_rule.op import DeltaArgs

# Most steps per chunk: the sequential loop runs n = ceil(T / 64) steps of (C, K) x (K, V)
# matmuls, C = ceil(T / n) (equal chunks: Gated DeltaProduct's 74 steps at the study's 37
# tokens run as 2 chunks of 37, twice as fast as 64 + 10 padded to 128).
CHUNK_SIZE = 64
# With a decay per key channel and strong decays, the in-chunk decays are (C, C, K) per chunk
# (T C K floats in all): at the study's model (B32 T37 H1 K=V=64, one thread) chunks of 8 / 16 /
# 32 steps took 18 / 34 / 126 ms forward+backward; factored (moderate decays) about the same at
# each length, which a chunk of 8 keeps below SAFE_DECAY the longest.
KEY_CHUNK_SIZE = 8
# The largest total log decay of a chunk for which a per-channel Gamma is formed from two factors
# (as Mamba-3's path does): exp(30) is far from float32's overflow, and the rounding of G
# (|G| * 6e-8) costs at most ~2e-6 relative per factor.
SAFE_DECAY = 30.0
# Up to this many positions per row, their states are formed one by one (a masked matmul
# each); more, and every state of the sequence is formed (a running sum) and picked from.
FEW_POSITIONS = 4


def _chunking(args: DeltaArgs) -> tuple[int, int]:
    T = args.q.shape[1]
    per_key = args.g is not None and args.g.dim() == 4
    n = -(-T // (KEY_CHUNK_SIZE if per_key else CHUNK_SIZE))
    return -(-T // n), n  # n chunks of equal length, so the padding is under n steps


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
    args: DeltaArgs, states: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The forward's saved buffers, unfilled: U rows (n, B, H, C, V), chunk start states
    (n, B, H, K, V; None without `states`) and A (n, B, H, C, C), in float32 (float64 for
    float64 inputs). The PyTorch path has one kernel: `args.kernel` is ignored."""
    q, v = args.q, args.v
    B, T, H, K = q.shape
    V = v.shape[-1]
    chunk, n = _chunking(args)
    dtype = compute_dtype(q)
    return (
        q.new_empty(n, B, H, chunk, V, dtype=dtype),
        q.new_empty(n, B, H, K, V, dtype=dtype) if states else None,
        q.new_empty(n, B, H, chunk, chunk, dtype=dtype),
    )


class Chunks(NamedTuple):
    """The inputs cut into chunks, (n, B, H, C, .) in the compute dtype."""

    q: torch.Tensor  # (.., K), pre-scaled
    k: torch.Tensor  # (.., K)
    v: torch.Tensor  # (.., V)
    beta: torch.Tensor  # (.., 1)
    g: torch.Tensor | None  # (.., 1), (.., K) for a decay per key channel, None without a gate
    p: torch.Tensor | None  # (.., K) Comba's recall key, or None

    @property
    def recall(self) -> torch.Tensor:
        """The key each step recalls with: p (Comba) or k."""
        return self.k if self.p is None else self.p


def _chunked_inputs(a: DeltaArgs) -> Chunks:
    compute = compute_dtype(a.q)
    chunk, n = _chunking(a)
    cut = lambda x: None if x is None else _to_chunks(x.to(compute), chunk, n)  # noqa: E731
    g = None if a.g is None else cut(a.g if a.g.dim() == 4 else a.g.unsqueeze(-1))
    return Chunks(cut(a.q) * a.scale, cut(a.k), cut(a.v), cut(a.beta.unsqueeze(-1)), g, cut(a.p))


class Factored(NamedTuple):
    """A per-channel Gamma[i, j] = exp(G_i) exp(-G_j) for j <= i (j < i when `strict`), kept as
    its two factors (n, B, H, C, K)."""

    e: torch.Tensor  # exp(G)
    inv: torch.Tensor  # exp(-G)
    strict: bool

    def dense(self) -> torch.Tensor:
        """Gamma as a (n, B, H, C, C, K) tensor, zero above the diagonal (on it when strict)."""
        C = self.e.shape[-2]
        mask = torch.ones(C, C, dtype=torch.bool, device=self.e.device).tril(-int(self.strict))
        return self.e[..., :, None, :] * self.inv[..., None, :, :] * mask[:, :, None]


class Decays(NamedTuple):
    """A chunk's decays from its log decays g (see the module docstring); the last axis is 1 for
    a decay per head, K for one per key channel (Gamma then (n, B, H, C, C, K))."""

    e: torch.Tensor  # (n, B, H, C, 1 or K) exp(G)
    w: torch.Tensor  # (n, B, H, C, 1 or K) exp(G_C - G)
    last: torch.Tensor  # (n, B, H, 1 or K, 1) e_C, scaling S's rows
    gamma: torch.Tensor | Factored  # (n, B, H, C, C[, K]) Gamma, zero above the diagonal
    e_r: torch.Tensor  # the decays of the recalls: e, or Comba's exp(G_{i-1})
    gamma_r: torch.Tensor | Factored  # of the recalls: strictly lower; Comba's exp(G_{i-1} - G_j)

    def dense_gamma(self) -> torch.Tensor:
        return self.gamma.dense() if isinstance(self.gamma, Factored) else self.gamma


def _decays(g: torch.Tensor | None, recall_first: bool = False) -> Decays | None:
    """The decays of the chunks' g (n, B, H, C, 1 or K); None without a gate. `recall_first`:
    Comba's recalls, before each step's decay."""
    if g is None:
        return None
    C, per_key = g.shape[3], g.shape[-1] > 1
    if per_key and not recall_first:
        G = g.cumsum(3)
        if bool((G[..., -1, :] >= -SAFE_DECAY).all()):
            return _factored(g, G)
    ones = torch.ones(C, C, dtype=torch.bool, device=g.device)
    lower, strict = (ones.tril(), ones.tril(-1)) if not per_key else (
        ones.tril()[:, :, None], ones.tril(-1)[:, :, None])  # fmt: skip
    rows = g[..., :, None, :] if per_key else g  # [l, j] = g_l, over the (C, C) pairs
    # seg[i, j] = g_{j+1} + ... + g_i: each column summed from zero, never G_i - G_j.
    seg = (rows * strict).cumsum(-3 if per_key else -2)
    gamma = seg.exp() * lower
    G = g.cumsum(3)
    e, last_row = G.exp(), G[..., -1, :]
    w = seg[..., -1, :, :] if per_key else seg[..., -1, :].unsqueeze(-1)
    last = last_row.exp().unsqueeze(-1) if per_key else last_row.exp()[..., None]
    if recall_first:  # row i of Gamma_r and e_r is row i - 1 of Gamma and e (zero, one at i = 0)
        gamma_r = F.pad(gamma, (0, 0, 0, 0, 1, -1) if per_key else (0, 0, 1, -1))
        e_r = torch.cat([torch.ones_like(e[..., :1, :]), e[..., :-1, :]], dim=-2)
    else:
        gamma_r, e_r = gamma * strict, e
    return Decays(e, w.exp(), last, gamma, e_r, gamma_r)


def _factored(g: torch.Tensor, G: torch.Tensor) -> Decays:
    """Per-channel decays with Gamma as two factors (moderate decays: see SAFE_DECAY)."""
    e, inv = G.exp(), (-G).exp()
    after = g.flip(3).cumsum(3).flip(3)  # g_j + ... + g_C, summed directly
    w = F.pad(after[..., 1:, :], (0, 0, 0, 1)).exp()  # exp(g_{j+1} + ... + g_C)
    last = e[..., -1, :].unsqueeze(-1)
    return Decays(e, w, last, Factored(e, inv, False), e, Factored(e, inv, True))


def _pairs(a: torch.Tensor, b: torch.Tensor, gamma: torch.Tensor | None) -> torch.Tensor:
    """sum_d a_id b_jd Gamma[i, j](d), (.., C, C): a @ b^T times Gamma (per channel when Gamma
    has one)."""
    if gamma is None:
        return a @ b.transpose(-1, -2)
    if isinstance(gamma, Factored):
        return ((a * gamma.e) @ (b * gamma.inv).transpose(-1, -2)).tril(-int(gamma.strict))
    if gamma.dim() == a.dim():
        return (a @ b.transpose(-1, -2)) * gamma
    # Per channel: row i is (Gamma[i] * b) a_i, a batch of (C, K) x (K, 1) products.
    return ((gamma * b[..., None, :, :]) @ a[..., :, :, None]).squeeze(-1)


def _mix(m: torch.Tensor, x: torch.Tensor, gamma, transposed: bool = False) -> torch.Tensor:
    """sum_j m_ij Gamma[i, j] x_j, or (`transposed`) sum_i m_ij Gamma[i, j] x_i, (.., C, D):
    m @ x through Gamma (per channel when Gamma has one; None: m as it is). A factored Gamma
    takes m zero where Gamma is (as the backward's are)."""
    if isinstance(gamma, Factored):
        if transposed:
            return gamma.inv * (m.transpose(-1, -2) @ (gamma.e * x))
        return gamma.e * (m @ (gamma.inv * x))
    if gamma is None or gamma.dim() == m.dim():
        mg = m if gamma is None else m * gamma
        return (mg.transpose(-1, -2) if transposed else mg) @ x
    # Per channel: row i is m_i (Gamma[i] * x), a batch of (1, C) x (C, K) products (transposed:
    # column j, m[:, j]^T (Gamma[:, j] * x)).
    if transposed:
        gx = (gamma * x[..., :, None, :]).transpose(-3, -2)  # [j, i, d]
        return (m.transpose(-1, -2)[..., :, None, :] @ gx).squeeze(-2)
    return (m[..., :, None, :] @ (gamma * x[..., None, :, :])).squeeze(-2)


def _scores(x: Chunks, decays: Decays | None) -> torch.Tensor:
    """P = tril(Q K^T) * Gamma, (n, B, H, C, C): what each step reads of the chunk's writes."""
    if decays is None:
        return (x.q @ x.k.transpose(-1, -2)).tril()
    return _pairs(x.q, x.k, decays.gamma)


def _lower(rb: torch.Tensor, x: Chunks, decays: Decays | None) -> torch.Tensor:
    """L = tril(Rb K^T, -1) * Gamma_r, (n, B, H, C, C); Rb = diag(beta) times the recall key."""
    if decays is None:
        return (rb @ x.k.transpose(-1, -2)).tril(-1)
    return _pairs(rb, x.k, decays.gamma_r)


def _decayed(x: torch.Tensor, by: torch.Tensor | None) -> torch.Tensor:
    """x times a decay (x itself without a gate)."""
    return x if by is None else x * by


class _Pass(NamedTuple):
    """The chunked forward pass (`_run`)."""

    x: Chunks
    decays: Decays | None
    u: torch.Tensor  # (n, B, H, C, V)
    h: torch.Tensor | list  # start states (n, B, H, K, V), or as they ran (None: zero)
    a: torch.Tensor  # (n, B, H, C, C)
    state: torch.Tensor | None  # after the last chunk, or its start without output_final_state


def _run(args: DeltaArgs, save: bool = True) -> _Pass:
    """The chunked recurrence. The state after the last chunk is formed only with
    `output_final_state` (else `state` is the last chunk's start). Without `save` (no backward
    will run) the start states are not copied into a buffer: h is the list of them as they ran,
    None for a zero one."""
    x = _chunked_inputs(args)
    decays = _decays(x.g, recall_first=x.p is not None)
    u, h, a = empty_saved(args, states=save)
    rb = x.recall * x.beta
    lower = _lower(rb, x, decays)
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    torch.linalg.solve_triangular(
        eye + lower, eye.expand_as(lower), upper=False, unitriangular=True, out=a
    )
    w, last, e_r = (None, None, None) if decays is None else (decays.w, decays.last, decays.e_r)
    state = None if args.initial_state is None else args.initial_state.to(u.dtype)
    w_v = a @ (x.v * x.beta)
    # A (diag(e)) Rb is applied to a nonzero start state only: not at all in one chunk from zero.
    w_k = None if state is None and u.shape[0] == 1 else a @ _decayed(rb, e_r)
    kw = _decayed(x.k, w)
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
            write = kw[c].transpose(-1, -2) @ u[c]
            state = write if state is None else _decayed(state, _at(last, c)) + write
    return _Pass(x, decays, u, h if save else starts, a, state)


def _at(x: torch.Tensor | None, c: int) -> torch.Tensor | None:
    return None if x is None else x[c]


def _output(p: _Pass, h: torch.Tensor | None) -> torch.Tensor:
    """O (n, B, H, C, V) from the chunks' start states h (None: all zero)."""
    o = _scores(p.x, p.decays) @ p.u
    if h is not None:
        o += _decayed(p.x.q, None if p.decays is None else p.decays.e) @ h
    return o


def _stacked(starts: list) -> torch.Tensor | None:
    """The chunks' start states as one (n, B, H, K, V) tensor (a view for one chunk), None
    for a single zero one; only the first chunk's start may be zero (None)."""
    if len(starts) == 1:
        return None if starts[0] is None else starts[0][None]
    first = torch.zeros_like(starts[1]) if starts[0] is None else starts[0]
    return torch.stack([first, *starts[1:]])


def forward(args: DeltaArgs) -> tuple[torch.Tensor, ...]:
    """o (B, T, H, V) in q's dtype (contiguous), the final state (B, H, K, V) in float32
    (float64 for float64 inputs) or None, and the buffers the backward needs (`empty_saved`).
    """
    marks = nonfinite.marks(args)
    p = _run(marks.finite)
    o = _from_chunks(_output(p, p.h), args.q.shape[1]).to(args.q.dtype).contiguous()
    final = p.state if args.output_final_state else None
    return marks.output(o), marks.final_state(final), p.u, p.h, p.a


def forward_inference(args: DeltaArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, the final state or None) as `forward`, when no backward will run: the chunks'
    start states are not copied into a saved buffer (a zero one is left out)."""
    marks = nonfinite.marks(args)
    p = _run(marks.finite, save=False)
    o = _from_chunks(_output(p, _stacked(p.h)), args.q.shape[1]).to(args.q.dtype).contiguous()
    return marks.output(o), marks.final_state(p.state if args.output_final_state else None)


def forward_out_at(args: DeltaArgs, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(o (B, 1, H, V) at step at[b] of each row b alone, the final state or None), without
    gradients: o_t = S_t^T q_t with S_t the chunk's (decayed) start state plus its writes up to
    t. The chunks' start states are kept as they run, not copied into a buffer."""
    marks = nonfinite.marks(args)
    p = _run(marks.finite, save=False)
    chunk, rows = p.x.q.shape[3], torch.arange(len(at), device=at.device)
    c, j = at // chunk, at % chunk
    pick = (lambda x: x[0]) if p.u.shape[0] == 1 else (lambda x: x[c, rows])  # noqa: E731
    row_j = lambda x: pick(x)[rows, :, j][:, :, None]  # (B, H, 1, .): row j  # noqa: E731
    q_at = row_j(p.x.q)  # (B, H, 1, K)
    if p.decays is None:
        scores = q_at @ pick(p.x.k).transpose(-1, -2)  # (B, H, 1, C)
        later = torch.arange(chunk, device=at.device) > j[:, None]  # (B, C): written after t
        scores = scores.masked_fill(later[:, None, None, :], 0.0)
    else:  # Gamma's row j, (B, H, 1, C[, K])
        scores = _pairs(q_at, pick(p.x.k), row_j(p.decays.dense_gamma()))
    o = scores @ pick(p.u)  # (B, H, 1, V)
    h = _stacked(p.h)
    if h is not None:
        o = o + _decayed(q_at, None if p.decays is None else row_j(p.decays.e)) @ pick(h)
    final = p.state if args.output_final_state else None
    return marks.output_at(o.transpose(1, 2).to(args.q.dtype), at), marks.final_state(final)


def forward_states_at(args: DeltaArgs, at: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(o, the final state (None unless `output_final_state`), the states after steps
    at[b, :] of each row b (B, P, H, K, V) in the compute dtype), without gradients. Inside a
    chunk the state after step j is e_j S + sum_{i <= j} Gamma[j, i] k_i u_i^T, from the
    chunk's start state S (without a gate: S plus the chunk's rank-one writes up to j)."""
    marks = nonfinite.marks(args)
    p = _run(marks.finite)
    o = _from_chunks(_output(p, p.h), args.q.shape[1]).to(args.q.dtype).contiguous()
    final = p.state if args.output_final_state else None
    if at.shape[1] > FEW_POSITIONS:
        states = _every_state(p)[torch.arange(at.shape[0], device=at.device)[:, None], at]
    else:
        states = _states_one_by_one(p, at)
    return marks.output(o), marks.final_state(final), marks.states_at(states, at)


def _every_state(p: _Pass) -> torch.Tensor:
    """Every step's state, (B, T', H, K, V) (T' the padded length): the running sum over each
    chunk's steps, one in-place add per step (cumsum over a middle axis is about 5x slower on
    CPU)."""
    n, B, H, K, V = p.h.shape
    chunk = p.u.shape[3]
    states = p.x.k[..., :, None] * p.u[..., None, :]  # (n, B, H, C, K, V): the writes
    step = None if p.x.g is None else p.x.g.exp()[..., None]  # exp(g_j): (n, B, H, C, 1, 1)
    states[:, :, :, 0] += _decayed(p.h, _at_step(step, 0))
    for j in range(1, chunk):
        states[:, :, :, j] += _decayed(states[:, :, :, j - 1], _at_step(step, j))
    return states.permute(1, 0, 3, 2, 4, 5).reshape(B, n * chunk, H, K, V)


def _at_step(step: torch.Tensor | None, j: int) -> torch.Tensor | None:
    return None if step is None else step[:, :, :, j]


def _states_one_by_one(p: _Pass, at: torch.Tensor) -> torch.Tensor:
    """The states after steps at (B, P), (B, P, H, K, V): one masked matmul each."""
    chunk, h = p.u.shape[3], p.h
    rows = torch.arange(at.shape[0], device=at.device)[:, None]
    c, j = at // chunk, at % chunk  # (B, P): each position's chunk and step in it
    if p.decays is None:  # (B, P, 1, C): the steps written by j
        weights = (torch.arange(chunk, device=at.device) <= j[..., None])[:, :, None].to(h.dtype)
        start = h[c, rows]
    else:  # (B, P, H, C[, K]): Gamma[j, i], zero for i > j
        weights = p.decays.dense_gamma()[c, rows, :, j]
        start = p.decays.e[c, rows, :, j][..., None] * h[c, rows]  # e: (B, P, H, 1 or K, 1)
    per_key = weights.dim() == 5
    keys = p.x.k[c, rows] * (weights if per_key else weights[..., None])  # (B, P, H, C, K)
    return start + keys.transpose(-1, -2) @ p.u[c, rows]


def backward(args: DeltaArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (dq, dk, dv, dp, dg, dbeta, dinitial_state) in the compute dtype; None for an
    absent p, g or initial_state."""
    do = grads[0]
    dfinal = grads[1] if args.output_final_state else None
    T, scale = args.q.shape[1], args.scale
    u, h, a = saved
    x = _chunked_inputs(args)
    d = _decays(x.g, recall_first=x.p is not None)
    e, w, last, e_r = (None,) * 4 if d is None else (d.e, d.w, d.last, d.e_r)
    doc = _to_chunks(do.to(h.dtype), *_chunking(args))
    rb = x.recall * x.beta
    # The reverse pass over chunks: dh, the gradient of each chunk's end state, and dR, that of
    # R = diag(beta) V - diag(e_r) Rb S.
    p_t = _scores(x, d).transpose(-1, -2)
    kw, rbe, qe = _decayed(x.k, w), _decayed(rb, e_r), _decayed(x.q, e)
    dstate = h.new_zeros(h.shape[1:]) if dfinal is None else dfinal.to(h.dtype)
    dh = torch.empty_like(h)
    dr = torch.empty_like(u)
    for c in reversed(range(h.shape[0])):
        dh[c] = dstate
        du = p_t[c] @ doc[c] + kw[c] @ dstate
        torch.matmul(a[c].transpose(-1, -2), du, out=dr[c])
        dstate = (
            _decayed(dstate, _at(last, c))
            + qe[c].transpose(-1, -2) @ doc[c]
            - rbe[c].transpose(-1, -2) @ dr[c]
        )
    # Everything else is parallel over chunks. Through P = tril(Q K^T) * Gamma and
    # L = tril(Rb K^T, -1) * Gamma_r, each operand's gradient:
    d_p = (doc @ u.transpose(-1, -2)).tril()
    d_lower = -(dr @ u.transpose(-1, -2)).tril(-1)
    gamma, gamma_r = (None, None) if d is None else (d.gamma, d.gamma_r)
    q_p, k_p = _mix(d_p, x.k, gamma), _mix(d_p, x.q, gamma, transposed=True)
    rb_l, k_l = _mix(d_lower, x.k, gamma_r), _mix(d_lower, rb, gamma_r, transposed=True)
    do_h = doc @ h.transpose(-1, -2)  # (n, B, H, C, K)
    dr_h = dr @ h.transpose(-1, -2)
    u_dh = u @ dh.transpose(-1, -2)
    d_rb = rb_l - _decayed(dr_h, e_r)  # gradient of Rb
    dq = (_decayed(do_h, e) + q_p) * scale
    dk = _decayed(u_dh, w) + k_p + k_l
    d_recall = x.beta * d_rb
    if x.p is None:
        dk = dk + d_recall
    dv = x.beta * dr
    dbeta = (d_rb * x.recall).sum(-1, keepdim=True) + (dr * x.v).sum(-1, keepdim=True)
    dg = None
    if d is not None:
        dG = _decay_grad(x, d, rb, d_rb, q_p + _decayed(do_h, e), k_p + k_l, u_dh, h, dh)
        dg = _from_chunks(dG.flip(3).cumsum(3).flip(3), T)  # G_i = g_1 + ... + g_i
        dg = dg.squeeze(-1) if args.g.dim() == 3 else dg
    return [
        _from_chunks(dq, T),
        _from_chunks(dk, T),
        _from_chunks(dv, T),
        None if x.p is None else _from_chunks(d_recall, T),
        dg,
        _from_chunks(dbeta, T).squeeze(-1),
        None if args.initial_state is None else dstate,
    ]


def _decay_grad(x: Chunks, d: Decays, rb, d_rb, dq_scaled, dk_gamma, u_dh, h, dh):
    """The gradient of each chunk's cumulative log decays G (n, B, H, C, 1 or K), channel by
    channel: a term X Y^T * Gamma with Gamma[i, j] = exp(G_i - G_j) gives G_i x_i * dx_i and G_j
    -y_j * dy_j; so do e (O, and R through e_r), w and e_C (S'). Comba's recalls read G_{i-1}:
    their part moves up one row. `dq_scaled`: the gradient of the (pre-scaled) Q through P and
    e; `dk_gamma`: K's through the Gamma factors of P and L."""
    through_w = _decayed(x.k * u_dh, d.w)
    dG = x.q * dq_scaled - x.k * dk_gamma - through_w
    recall = rb * d_rb  # through L's rows and R: G_i, or G_{i-1} for Comba
    if x.p is None:
        dG = dG + recall
    else:
        dG[..., :-1, :] += recall[..., 1:, :]
    through_last = d.last * (h * dh).sum(-1, keepdim=True)  # (n, B, H, 1 or K, 1)
    dG[..., -1, :] += through_last.squeeze(-1) + through_w.sum(-2)
    return dG if x.g.shape[-1] > 1 else dG.sum(-1, keepdim=True)
