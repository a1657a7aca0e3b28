"""The Mamba-3 drop-ins' input checks, by the peers' argument names, raised before anything
runs (mecheval_kernels.validation says how errors read)."""

from __future__ import annotations

import math

import torch

from mecheval_kernels.backend import resolve_backend
from mecheval_kernels.mamba3.prepare import Inputs
from mecheval_kernels.stacking import is_batched
from mecheval_kernels.validation import (
    FLOAT_DTYPES,
    allowed_dtypes,
    check_choice,
    check_same_device,
    check_tensor,
    refuse_unsupported,
)


def _backend(op: str, backend, tensors: dict, layout: str) -> tuple[str, tuple]:
    """(the backend that runs the core, the input dtypes it takes); Q is checked first, so that
    a Q that is no tensor is refused by name."""
    check_tensor(op, "Q", tensors["Q"], layout, {})
    present = {k: v for k, v in tensors.items() if isinstance(v, torch.Tensor)}
    chosen = resolve_backend(op, backend, check_same_device(op, **present))
    return chosen, allowed_dtypes(chosen)


def _common(op: str, dtypes, sizes: dict, V, ADT, DT, Trap, Angles, D, Z, angles: str) -> None:
    """V, ADT, DT, Trap, Angles, D, Z (after Q, K, which set B, L, G, N and R)."""
    check_tensor(op, "V", V, "B L H P", sizes, dtypes)
    H = sizes["H"]
    if H % sizes["G"]:
        raise ValueError(f"{op}: the heads H = {H} of V must be a multiple of Q's groups G")
    for name, t in (("ADT", ADT), ("DT", DT), ("Trap", Trap)):
        check_tensor(op, name, t, "B H L", sizes, dtypes)
    check_tensor(op, "Angles", Angles, "B L H A", sizes, dtypes)
    if angles == "pairwise" and not 1 <= sizes["A"] <= sizes["N"] // 2:
        raise ValueError(f"{op}: Angles must have 1..N/2 = {sizes['N'] // 2} angles, got "
                         f"{sizes['A']}")  # fmt: skip
    check_tensor(op, "D", D, "H", sizes, dtypes, optional=True)
    check_tensor(op, "Z", Z, "B L H P", sizes, dtypes, optional=True)
    if sizes["N"] % 2:
        raise ValueError(f"{op}: the state size N = {sizes['N']} of Q and K must be even")
    _check_decays(op, ADT)


def _check_decays(op: str, ADT: torch.Tensor) -> None:
    # A positive log decay grows the state without bound (exp of a chunk's summed decays
    # overflows): refuse it by name, on eager calls (a data-dependent test).
    traced = torch.compiler.is_compiling() or is_batched(ADT) or ADT.device.type == "meta"
    if traced or not ADT.numel() or bool((torch.isfinite(ADT) & (ADT <= 0)).all()):
        return
    if not bool(torch.isfinite(ADT).all()):
        raise ValueError(f"{op}: ADT (the log decays A dt) must be finite, got inf or NaN")
    raise ValueError(
        f"{op}: ADT (the log decays A dt) must be <= 0, got positive values (largest "
        f"{float(ADT.max()):.4g}); a model's A = -softplus(.) is"
    )


def _flags(op: str, chunk_size, **flags) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be a bool, got {value!r}")


def _states(op: str, states, sizes: dict, dtypes, mimo_v=None) -> tuple | None:
    """Input_States as Inputs holds them: (theta, h, k (B, R, H, N), v projected (B, R, H, P));
    SISO's k is (B, H, N), MIMO's (B, R, H, N), and v is V's last step (B, H, P)."""
    if states is None:
        return None
    if not isinstance(states, (tuple, list)) or len(states) != 4:
        raise ValueError(f"{op}: Input_States must be a (theta, h, k, v) tuple or None")
    k_layout = "B H N" if mimo_v is None else "B R H N"
    layouts = ("B H A", "B H P N", k_layout, "B H P")
    for name, t, dims in zip(("theta", "h", "k", "v"), states, layouts, strict=True):
        check_tensor(op, f"Input_States {name}", t, dims, sizes, dtypes)
    theta, h, k, v = states
    if mimo_v is None:
        return theta, h, k[:, None], v[:, None]
    return theta, h, k, v[:, None] * mimo_v.to(v.dtype).transpose(0, 1)


def check_siso(backend, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, Input_States,
               chunk_size, return_final_states, cu_seqlens) -> tuple[Inputs, str]:  # fmt: skip
    """The validated SISO call (rank 1) and the backend that runs its core."""
    op = "mamba3_siso_combined"
    refuse_unsupported(op, cu_seqlens=(cu_seqlens, None))
    _flags(op, chunk_size, return_final_states=return_final_states)
    tensors = dict(Q=Q, K=K, V=V, ADT=ADT, DT=DT, Trap=Trap, Q_bias=Q_bias, K_bias=K_bias,
                   Angles=Angles, D=D, Z=Z)  # fmt: skip
    chosen, dtypes = _backend(op, backend, tensors, "B L G N")
    sizes: dict[str, int] = {}
    check_tensor(op, "Q", Q, "B L G N", sizes, dtypes)
    check_tensor(op, "K", K, "B L G N", sizes, (Q.dtype,))
    _common(op, dtypes, sizes, V, ADT, DT, Trap, Angles, D, Z, "pairwise")
    for name, t in (("Q_bias", Q_bias), ("K_bias", K_bias)):
        check_tensor(op, name, t, "H N", sizes, dtypes)
    states = _states(op, Input_States, sizes, dtypes)
    x = Inputs(Q[:, :, None], K[:, :, None], V, ADT, DT, Trap, Q_bias[:, None], K_bias[:, None],
               Angles, D, Z, None, None, None, None, False, 0.0, states, "pairwise",
               V.dtype)  # fmt: skip
    return x, chosen


def check_mimo(backend, Q, K, V, ADT, DT, Trap, Q_bias, K_bias, MIMO_V, MIMO_Z, MIMO_Out, Angles,
               D, Z, chunk_size, rotary_dim_divisor, dtype, return_state, cu_seqlens, fuse_norm,
               norm_weight, norm_eps, Input_States=None) -> tuple[Inputs, str]:  # fmt: skip
    """The validated MIMO call and the backend that runs its core."""
    op = "mamba3_mimo"
    refuse_unsupported(op, cu_seqlens=(cu_seqlens, None))
    _flags(op, chunk_size, return_state=return_state, fuse_pregate_headwise_rms_norm=fuse_norm)
    check_choice(op, "rotary_dim_divisor", rotary_dim_divisor, (2, 4))
    if dtype not in (*FLOAT_DTYPES, torch.float64):
        raise TypeError(f"{op}: dtype must be a floating-point torch.dtype, got {dtype!r}")
    tensors = dict(Q=Q, K=K, V=V, ADT=ADT, DT=DT, Trap=Trap, Q_bias=Q_bias, K_bias=K_bias,
                   MIMO_V=MIMO_V, MIMO_Z=MIMO_Z, MIMO_Out=MIMO_Out, Angles=Angles, D=D, Z=Z,
                   outproj_norm_weight=norm_weight)  # fmt: skip
    chosen, dtypes = _backend(op, backend, tensors, "B L R G N")
    sizes: dict[str, int] = {}
    check_tensor(op, "Q", Q, "B L R G N", sizes, dtypes)
    check_tensor(op, "K", K, "B L R G N", sizes, (Q.dtype,))
    _common(op, dtypes, sizes, V, ADT, DT, Trap, Angles, D, Z, "halves")
    if sizes["A"] * rotary_dim_divisor != sizes["N"]:
        wanted = sizes["N"] / rotary_dim_divisor
        raise ValueError(f"{op}: Angles must have N / rotary_dim_divisor = {wanted:g} angles, "
                         f"got {sizes['A']}")  # fmt: skip
    for name, t in (("Q_bias", Q_bias), ("K_bias", K_bias)):
        check_tensor(op, name, t, "H R N", sizes, dtypes)
    check_tensor(op, "MIMO_V", MIMO_V, "H R P", sizes, dtypes)
    check_tensor(op, "MIMO_Z", MIMO_Z, "H R P", sizes, dtypes, optional=Z is None)
    check_tensor(op, "MIMO_Out", MIMO_Out, "H R P", sizes, dtypes, optional=True)
    weight = _norm(op, fuse_norm, norm_weight, norm_eps, Z, sizes, dtypes)
    states = _states(op, Input_States, sizes, dtypes, MIMO_V)
    x = Inputs(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D, Z, MIMO_V,
               MIMO_Z if Z is not None else None, MIMO_Out, weight, bool(fuse_norm),
               float(norm_eps), states, "halves", dtype)  # fmt: skip
    return x, chosen


def _norm(op, fuse_norm, weight, eps, Z, sizes, dtypes) -> torch.Tensor | None:
    """The fused norm's weight as (H, P) (or None)."""
    if not fuse_norm:
        return None
    if Z is None:
        raise ValueError(f"{op}: fuse_pregate_headwise_rms_norm=True needs Z and MIMO_Z")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps):
        raise TypeError(f"{op}: outproj_norm_eps must be a finite float, got {eps!r}")
    if weight is None:
        return None
    if isinstance(weight, torch.Tensor) and weight.dim() == 1:
        check_tensor(op, "outproj_norm_weight", weight, "HP", {"HP": sizes["H"] * sizes["P"]},
                     dtypes)  # fmt: skip
        return weight.view(sizes["H"], sizes["P"])
    check_tensor(op, "outproj_norm_weight", weight, "H P", sizes, dtypes)
    return weight
