"""ShortConvolution: a short causal depthwise convolution over (B, L, C), on `mecheval_kernels`.

Follows flash-linear-attention's `fla.modules.ShortConvolution`: an `nn.Conv1d` subclass (weight (C,
1, W), optional bias (C,)), input and output (B, L, C), an optional SiLU fused into the kernel, and
`forward` returning `(y, final_state)`. Differences: the carried state is the last W - 1 inputs, (B,
C, W - 1), as `mecheval_kernels.causal_conv1d_fn` takes it (fla keeps W columns), and there is no
`mask` / `residual` / `cu_seqlens`.
"""

from __future__ import annotations

import torch
from torch import nn

import mecheval_kernels

ACTIVATIONS = (None, "silu", "swish")


class ShortConvolution(nn.Conv1d):
    """Causal depthwise convolution of width W over the time axis of a (B, L, C) tensor.

    y[b, t, c] = act(bias[c] + sum_{i < W} weight[c, 0, i] * x[b, t - W + 1 + i, c]), with x
    zero (or `cache`) before position 0.

    Args:
        hidden_size: channels C.
        kernel_size: width W, 1 to 8 (the kernel's range).
        bias: whether to learn a per-channel bias.
        activation: None, "silu" or "swish" (fused into the convolution kernel).
        device: parameter device.
        dtype: parameter dtype.
    """

    def __init__(
        self,
        hidden_size: int,
        kernel_size: int,
        bias: bool = False,
        activation: str | None = "silu",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        if not 1 <= kernel_size <= 8:
            raise ValueError(f"kernel_size must be in 1..8, got {kernel_size}")
        super().__init__(
            in_channels=hidden_size,
            out_channels=hidden_size,
            kernel_size=kernel_size,
            groups=hidden_size,
            padding=kernel_size - 1,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        self.hidden_size = hidden_size
        self.activation = activation

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, activation={self.activation!r}"

    def forward(
        self,
        x: torch.Tensor,
        cache: torch.Tensor | None = None,
        output_final_state: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Convolve.

        Args:
            x: (B, L, C).
            cache: optional (B, C, W - 1), the W - 1 inputs before x[:, 0].
            output_final_state: also return the last W - 1 inputs, (B, C, W - 1).

        Returns:
            (y (B, L, C), final_state (B, C, W - 1) or None).
        """
        weight = self.weight[:, 0, :]
        out = mecheval_kernels.causal_conv1d_fn(
            x.transpose(1, 2),
            weight,
            self.bias,
            activation=self.activation,
            initial_states=cache,
            return_final_states=output_final_state,
        )
        if output_final_state:
            y, final_state = out
            return y.transpose(1, 2), final_state
        return out.transpose(1, 2), None
