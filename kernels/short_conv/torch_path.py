"""The PyTorch path of the short convolution (the CPU fast path), with its own backward.

W shifted multiply-adds over the padded input beat a grouped conv1d on CPU at these widths;
the backward uses PyTorch's fused SiLU derivative, W shifted multiply-adds for the input
gradient and one grouped convolution (input windows x output gradient) for the weight
gradient. All in float32 (float64 stays float64), like the Triton path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.layout import match_layout


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _padded(x: torch.Tensor, initial_states: torch.Tensor | None, width: int) -> torch.Tensor:
    """(B, D, W - 1 + L): the inputs before x (initial states or zeros), then x."""
    xc = x.to(_compute_dtype(x))
    if initial_states is None:
        return F.pad(xc, (width - 1, 0))
    return torch.cat([initial_states.to(xc.dtype), xc], dim=-1)


def _pre_activation(
    padded: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, length: int
):
    w = weight.to(padded.dtype)
    start = bias.to(padded.dtype)[:, None] if bias is not None else torch.zeros_like(w[:, :1])
    y = torch.addcmul(start, padded[..., :length], w[:, 0, None])
    for k in range(1, w.shape[1]):
        y.addcmul_(padded[..., k : k + length], w[:, k, None])
    return y


def forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    initial_states: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """x (B, D, L), weight (D, W) -> y (B, D, L) in x's dtype and layout."""
    y = _pre_activation(_padded(x, initial_states, weight.shape[1]), weight, bias, x.shape[-1])
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
    B, D, L = x.shape
    W = weight.shape[1]
    padded = _padded(x, initial_states, W)
    g = dy.to(padded.dtype)
    if silu:
        g = torch.ops.aten.silu_backward(g, _pre_activation(padded, weight, bias, L))
    w = weight.to(padded.dtype)
    dpadded = torch.zeros_like(padded)
    for k in range(W):  # y[t] reads padded[t + k] with weight k
        dpadded[..., k : k + L].addcmul_(g, w[:, k, None])
    # dweight[d, k] = sum_{b, t} g[b, d, t] * padded[b, d, t + k]: a correlation per (b, d).
    windows = F.conv1d(padded.reshape(1, B * D, L + W - 1), g.reshape(B * D, 1, L), groups=B * D)
    dweight = windows.reshape(B, D, W).sum(0).to(weight.dtype)
    dbias = None if bias is None else g.sum((0, 2)).to(bias.dtype)
    dx = match_layout(dpadded[..., W - 1 :].to(x.dtype), x)
    dinit = None
    if initial_states is not None:  # a copy: custom-op outputs may not alias each other
        dinit = dpadded[..., : W - 1].to(initial_states.dtype).clone()
    return [dx, dweight, dbias, dinit]
