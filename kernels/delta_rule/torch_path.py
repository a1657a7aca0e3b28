"""The PyTorch path of the delta rule (CPU fast path): the chunked WY form in batched matmuls.

Within a chunk of C steps starting from state S, the per-step recurrence unrolls to

    (I + tril(diag(beta) K K^T, -1)) U = diag(beta) (V - K S)      # U: the chunk's u_t rows
    O = scale * (Q S + tril(Q K^T) U)                               # tril keeps the diagonal
    S' = S + K^T U

so with W_k = M^{-1} diag(beta) K and W_v = M^{-1} diag(beta) V (one triangular solve for every
chunk at once, M the unit lower-triangular matrix on the left), only U = W_v - W_k S, O and S'
are left to the sequential loop over chunks: T / C steps of matmuls instead of T steps of
matrix-vector products. The sequence is zero-padded to a multiple of C (padded steps have
k = 0 and beta = 0, so they leave the state alone).

The backward is the vector-Jacobian product of this forward (torch.func.vjp), which keeps the
chunk-boundary states, not the per-step ones.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.vjp import vjp_of

# Sequences shorter than this are one chunk of their own length.
CHUNK_SIZE = 64


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _to_chunks(x: torch.Tensor, chunk: int, num_chunks: int) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, num_chunks, chunk, D), zero-padded along T."""
    B, T, H, D = x.shape
    x = x.transpose(1, 2)
    pad = num_chunks * chunk - T
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    return x.reshape(B, H, num_chunks, chunk, D)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    output_final_state: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q, k (B, T, H, K), v (B, T, H, V), beta (B, T, H), initial_state (B, H, K, V).

    Returns o (B, T, H, V) in q's dtype (contiguous) and, with `output_final_state`, the final
    state (B, H, K, V) in float32 (float64 for float64 inputs).
    """
    compute = _compute_dtype(q)
    B, T, H, K = q.shape
    V = v.shape[-1]
    chunk = min(CHUNK_SIZE, T)
    n = -(-T // chunk)
    qc, kc, vc = (_to_chunks(t.to(compute), chunk, n) for t in (q, k, v))
    bc = _to_chunks(beta.to(compute).unsqueeze(-1), chunk, n)  # (B, H, n, C, 1)
    kb = kc * bc
    lower = (kb @ kc.transpose(-1, -2)).tril(-1)
    eye = torch.eye(chunk, dtype=compute, device=q.device)
    w = torch.linalg.solve_triangular(
        eye + lower, torch.cat([kb, vc * bc], dim=-1), upper=False, unitriangular=True
    )
    w_k, w_v = w.split([K, V], dim=-1)
    qk = (qc @ kc.transpose(-1, -2)).tril()
    if initial_state is None:
        state = q.new_zeros(B, H, K, V, dtype=compute)
    else:
        state = initial_state.to(compute)
    outputs = []
    for c in range(n):
        u = w_v[:, :, c] - w_k[:, :, c] @ state
        outputs.append(qc[:, :, c] @ state + qk[:, :, c] @ u)
        state = state + kc[:, :, c].transpose(-1, -2) @ u
    o = (torch.stack(outputs, dim=2) * scale).reshape(B, H, n * chunk, V)[:, :, :T]
    o = o.transpose(1, 2).to(q.dtype).contiguous()
    return o, (state if output_final_state else None)


def backward(
    do: torch.Tensor,
    dfinal: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
) -> list[torch.Tensor | None]:
    """Gradients (dq, dk, dv, dbeta, dinitial_state); None for an absent initial_state.

    `dfinal` is the gradient of the final state, or None when it was not an output.
    """
    with_final = dfinal is not None

    def run(q_, k_, v_, b_, s_):
        o, final = forward(q_, k_, v_, b_, scale, s_, with_final)
        return (o, final) if with_final else o

    cotangents = (do, dfinal) if with_final else do
    return vjp_of(run, (q, k, v, beta, initial_state), cotangents)
