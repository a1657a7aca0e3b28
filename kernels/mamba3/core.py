"""The core recurrence of Mamba-3's scan (`CoreArgs`, custom ops
`mecheval_kernels::mamba3_core_fwd` / `_bwd`; the scaffold is mecheval_kernels._op): per batch
row and head, h_t = exp(a_t) h_{t-1} + s_t sum_r v_{t,r} k_{t,r}^T, y_{t,r} = h_t q_{t,r}
(h (P, N), R ranks a step). It runs on the PyTorch path (torch_path.py, chunked) or the Triton
kernels (recurrent.py, launch.py), in float32 (float64 for float64 inputs on the PyTorch path).
The drop-ins around it: mecheval_kernels.mamba3.op.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mecheval_kernels._op import Op, compute_dtype
from mecheval_kernels.stacking import fold_into, unfold_from


class CoreArgs(NamedTuple):
    """The core's inputs: q, k (B, L, R, H, N); v (B, L, R, H, P); a (the log decays, <= 0),
    s (the write scales) (B, L, H); initial_state (B, H, P, N) or None; all in one float
    dtype."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    a: torch.Tensor
    s: torch.Tensor
    initial_state: torch.Tensor | None
    output_final_state: bool


def _validate_core(dtypes, **arguments) -> None:
    """The core's inputs come from the drop-ins' validated arguments: nothing to refuse."""


def _fake(a: CoreArgs, backend: str) -> tuple:
    B, L, R, H, N = a.q.shape
    P = a.v.shape[-1]
    final = a.q.new_empty(B, H, P, N) if a.output_final_state else None
    saved = CORE.implementation(backend).empty_saved(a.q, a.v)
    return a.q.new_empty(B, L, R, H, P), final, saved


def _fold(a: CoreArgs, dims: CoreArgs, m: int):
    """Stacked models (mecheval_kernels.stacking): the model axis folds into the heads."""
    folded = a._replace(
        **{f: fold_into(getattr(a, f), getattr(dims, f), m, 3) for f in ("q", "k", "v")},
        **{f: fold_into(getattr(a, f), getattr(dims, f), m, 2) for f in ("a", "s")},
        initial_state=fold_into(a.initial_state, dims.initial_state, m, 1),
    )
    axes = (3, 1)
    return folded, lambda i, t: unfold_from(t, m, axes[i]) if i < 2 else (t, None)


CORE = Op(
    __package__, "mamba3", CoreArgs, "B L R H N", _validate_core, _fake, 3, 1, _fold,
    name="mamba3_core",
)  # fmt: skip


def run_core(a: CoreArgs, backend: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y (B, L, R, H, P), the final state or None) of the core, in its inputs' dtype."""
    if backend == "torch" and CORE.runs_plain(a):  # no backward: nothing kept for it
        return CORE.implementation("torch").forward_inference(a)
    y, final, _ = CORE(a, backend)
    return y, (final if a.output_final_state else None)


def core_dtype(x: torch.Tensor) -> torch.dtype:
    return compute_dtype(x)
