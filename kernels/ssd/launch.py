"""The Triton path of Mamba-2's scan (mecheval_kernels.ssd.op): Mamba-2 as a selective scan
(`selective_form`), run by the selective scan's Triton kernels, which keep their chunks' start
states for the backward; the backward runs the selective scan's Triton backward and sums the
gradients of what Mamba-2 broadcasts (A over each head's channels and state, dt, D and dt_bias
over its channels) back to Mamba-2's shapes."""

from __future__ import annotations

import torch

from mecheval_kernels.selective_scan import launch
from mecheval_kernels.selective_scan.op import ScanArgs
from mecheval_kernels.ssd.chunked import Inputs


def _scan_args(a: Inputs, save: bool) -> ScanArgs:
    from mecheval_kernels.ssd.op import selective_form

    form = selective_form(a)
    softplus = form.pop("delta_softplus")
    return ScanArgs(**form, softplus=softplus, save_checkpoints=save)


def num_checkpoints(batch: int, channels: int, N: int, length: int) -> int:
    return launch.num_checkpoints(batch, channels, N, length)


def forward(a: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (B, L, H, P) in x's dtype, contiguous, the final state (B, H, P, N) float32, the
    selective scan's checkpoints (none unless `save_checkpoints`))."""
    batch, length, heads, P = a.x.shape
    out, last, checkpoints = launch.forward(_scan_args(a, a.save_checkpoints))
    out = out.transpose(1, 2).unflatten(-1, (heads, P)).contiguous()
    return out, last.reshape(batch, heads, P, -1), checkpoints


def backward(a: Inputs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients of x, dt, A, B, C, D, z, dt_bias, initial_states (None for absent ones)."""
    batch, length, heads, P = a.x.shape
    s = _scan_args(a, save=True)
    dout, dfinal = grads
    channels = lambda t: t.reshape(batch, length, heads * P).transpose(1, 2)  # noqa: E731
    dout = None if dout is None else channels(dout)
    dfinal = None if dfinal is None or dfinal.numel() == 0 else dfinal.reshape(batch, heads * P, -1)
    du, ddelta, dA, dB, dC, dD, dz, dbias, dinit = launch.backward(s, (dout, dfinal), saved)
    per_head = lambda t: t.reshape(*t.shape[:-1], heads, P).sum(-1)  # noqa: E731
    back = lambda t: None if t is None else t.transpose(1, 2).unflatten(-1, (heads, P))  # noqa: E731
    if dD is not None:
        dD = per_head(dD) if a.D.dim() == 1 else dD.reshape(heads, P)
    return [
        back(du),
        per_head(ddelta.transpose(1, 2)),
        dA.reshape(heads, -1).sum(-1),
        dB.permute(0, 3, 1, 2),
        dC.permute(0, 3, 1, 2),
        dD,
        back(dz),
        None if dbias is None else per_head(dbias),
        None if dinit is None else dinit.reshape(batch, heads, P, -1),
    ]
