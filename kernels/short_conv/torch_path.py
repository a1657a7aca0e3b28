"""The PyTorch path of the short convolution (CPU fast path): one grouped conv1d."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.layout import match_layout
from kernels.vjp import vjp_of


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    # Half-precision convolutions are slow or missing on CPU; accumulate in float32 as the
    # Triton path does.
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """x (B, D, L), weight (D, W) -> y (B, D, L) in x's dtype."""
    compute = _compute_dtype(x)
    D, W = weight.shape
    xc = x.to(compute)
    if initial_states is None:
        padded = F.pad(xc, (W - 1, 0))
    else:
        padded = torch.cat([initial_states.to(compute), xc], dim=-1)
    b = None if bias is None else bias.to(compute)
    y = F.conv1d(padded, weight.to(compute).unsqueeze(1), b, groups=D)
    if silu:
        y = F.silu(y)
    return match_layout(y.to(x.dtype), x)


def backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    silu: bool,
) -> list[torch.Tensor | None]:
    """Gradients (dx, dweight, dbias, dinitial_states); None for absent inputs."""
    dx, dweight, dbias, dinit = vjp_of(
        lambda x_, w_, b_, s_: forward(x_, w_, b_, s_, silu),
        (x, weight, bias, initial_states),
        dy,
    )
    # dx and dinit are slices of one gradient buffer; a custom op's outputs may not alias.
    return [match_layout(dx, x), dweight, dbias, None if dinit is None else dinit.clone()]
