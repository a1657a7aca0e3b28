"""Mamba-3's scan, drop-ins for mamba-ssm's `mamba3_siso_combined`
(mamba_ssm.ops.triton.mamba3.mamba3_siso_combined) and `mamba3_mimo`
(mamba_ssm.ops.tilelang.mamba3.mamba3_mimo).

What runs where: the angles, rotations, trapezoid coefficients, MIMO projections, skip, gate and
norm are elementwise PyTorch around the core recurrence (prepare.py, autograd); the core runs
on the chosen backend (core.py). Packed sequences (`cu_seqlens`) are refused by name; the chunk
sizes (the peers' kernels') change nothing; mamba3_mimo's `dtype` is its output's dtype.
"""

from __future__ import annotations

import torch

from mecheval_kernels.mamba3 import prepare as pre
from mecheval_kernels.mamba3.core import run_core
from mecheval_kernels.mamba3.validation import check_mimo, check_siso


def run(x: pre.Inputs, backend: str, final: bool):
    """(out, the final (theta, h, k, v) or None) of validated inputs."""
    p = pre.prepare(x, final)
    y, h = run_core(p.core, backend)
    y = y - pre.correction(p.q, p.k, p.v, p.c_next)
    out = pre.output(x, y, p.v, x.Z)
    return out, (pre.final_states(x, p, h) if final else None)


def mamba3_siso_combined(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    ADT: torch.Tensor,
    DT: torch.Tensor,
    Trap: torch.Tensor,
    Q_bias: torch.Tensor,
    K_bias: torch.Tensor,
    Angles: torch.Tensor,
    D: torch.Tensor | None = None,
    Z: torch.Tensor | None = None,
    Input_States: tuple | None = None,
    chunk_size: int = 64,
    return_final_states: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    *,
    backend: str | None = None,
):
    """Mamba-3's SISO scan (mecheval_kernels.mamba3.reference), drop-in for mamba-ssm's
    `mamba3_siso_combined`.

    Args:
        Q, K: (B, L, G, N) queries (C) and keys (B), G groups of H / G heads; N even.
        V: (B, L, H, P) values (x); Z: optional (B, L, H, P) gate, out = y * silu(Z).
        ADT: (B, H, L) the log decays A dt (finite, <= 0; checked on eager calls).
        DT: (B, H, L) the step sizes; Trap: (B, H, L) the trapezoid's logits (sigmoid inside).
        Q_bias, K_bias: (H, N). Angles: (B, L, H, A), A <= N / 2 rotated pairs (2i, 2i + 1).
        D: optional (H,) skip.
        Input_States: optional (theta (B, H, A), h (B, H, P, N), k (B, H, N), v (B, H, P)).
        chunk_size: the peer's chunk length; no effect here.
        return_final_states: also return the final (theta, h, k, v).
        cu_seqlens: packed sequences; only None.
        backend: "auto", "triton" or "torch" (the core's; None: the process default).

    Returns:
        out (B, L, H, P) in V's dtype, or (out, theta mod 2 pi, h, k, v) in float32 (float64
        for float64 inputs). States after given steps, the output at one step, a patched state:
        `mecheval_kernels.at_positions(mecheval_kernels.mamba3_siso_combined, ...)`.
    """
    x, chosen = check_siso(
        backend, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States,
        chunk_size, return_final_states, cu_seqlens,
    )  # fmt: skip
    out, final = run(x, chosen, bool(return_final_states))
    if not return_final_states:
        return out
    theta, h, k, v = final
    return out, theta, h, k[:, 0], v[:, 0]


def mamba3_mimo(
    Q: torch.Tensor,
    K: torch.Tensor,
    V: torch.Tensor,
    ADT: torch.Tensor,
    DT: torch.Tensor,
    Trap: torch.Tensor,
    Q_bias: torch.Tensor,
    K_bias: torch.Tensor,
    MIMO_V: torch.Tensor,
    MIMO_Z: torch.Tensor | None,
    MIMO_Out: torch.Tensor | None,
    Angles: torch.Tensor,
    D: torch.Tensor | None,
    Z: torch.Tensor | None,
    chunk_size: int,
    rotary_dim_divisor: int,
    dtype: torch.dtype,
    return_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    fuse_pregate_headwise_rms_norm: bool = False,
    outproj_norm_weight: torch.Tensor | None = None,
    outproj_norm_eps: float = 1e-5,
    Input_States: tuple | None = None,
    *,
    backend: str | None = None,
):
    """Mamba-3's MIMO scan (mecheval_kernels.mamba3.reference), drop-in for mamba-ssm's
    `mamba3_mimo`.

    Args:
        Q, K: (B, L, R, G, N), R ranks. V, Z: (B, L, H, P); ADT, DT, Trap (B, H, L) as
            `mamba3_siso_combined` takes them. Q_bias, K_bias: (H, R, N).
        MIMO_V, MIMO_Z, MIMO_Out: (H, R, P) the rank projections of V, Z and the output
            (MIMO_Out None: the output keeps its ranks, (B, L, R, H, P)); MIMO_Z is needed
            with Z.
        Angles: (B, L, H, N / rotary_dim_divisor), rotating pairs (i, i + N/2).
        D: optional (H,) skip, per rank before the gate.
        chunk_size: the peer's chunk length; no effect. rotary_dim_divisor: 2 or 4.
        dtype: the output's dtype. return_state: also return the final states.
        cu_seqlens: only None.
        fuse_pregate_headwise_rms_norm: y <- rmsnorm(y) * outproj_norm_weight * silu(z) per
            rank and head (needs Z), with outproj_norm_weight (H, P) or (H P,) or None.
        Input_States (ours: the peer starts from zero): optional (theta (B, H, A), h (B, H, P,
            N), k (B, R, H, N), v (B, H, P): the last step's V), as return_state returns them.
        backend: as `mamba3_siso_combined` takes it.

    Returns:
        out, or (out, theta mod 2 pi (B, H, A), h (B, H, P, N), k (B, R, H, N), V's last step
        (B, H, P)).
    """
    x, chosen = check_mimo(
        backend, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles, D, Z,
        chunk_size, rotary_dim_divisor, dtype, return_state, cu_seqlens,
        fuse_pregate_headwise_rms_norm, outproj_norm_weight, outproj_norm_eps, Input_States,
    )  # fmt: skip
    out, final = run(x, chosen, bool(return_state))
    if not return_state:
        return out
    theta, h, k, _ = final
    return out, theta, h, k, V[:, -1]
