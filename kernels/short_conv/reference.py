"""The short causal depthwise convolution, written for clarity: the oracle of the tests.

    y[b, d, t] = act(bias[d] + sum_w weight[d, w] * x[b, d, t - (W - 1) + w])

where positions before 0 read `initial_states` (the W - 1 inputs that came before x) or zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x (B, D, L), weight (D, W), bias (D,), initial_states (B, D, W-1).

    Computes in float32 (float64 stays float64); returns y (B, D, L) in x's dtype and, with
    `return_final_states`, the last W - 1 inputs (B, D, W-1) for a following call.
    """
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    B, D, L = x.shape
    W = weight.shape[1]
    if initial_states is None:
        before = x.new_zeros(B, D, W - 1, dtype=compute)
    else:
        before = initial_states.to(compute)
    padded = torch.cat([before, x.to(compute)], dim=-1)  # (B, D, W - 1 + L)
    y = torch.zeros(B, D, L, dtype=compute, device=x.device)
    for w in range(W):
        y = y + weight[:, w, None].to(compute) * padded[:, :, w : w + L]
    if bias is not None:
        y = y + bias[:, None].to(compute)
    if activation in ("silu", "swish"):
        y = F.silu(y)
    y = y.to(x.dtype)
    if not return_final_states:
        return y
    return y, padded[:, :, L:].to(x.dtype)
