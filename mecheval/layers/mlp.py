"""The feed-forward block of a Transformer block: Linear, GELU, Linear, with biases (zoology's
`MLP`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """fc2(gelu(fc1(x))).

    Args:
        d_model: channels in and out.
        hidden_mult: hidden width = hidden_mult * d_model.
    """

    def __init__(self, d_model: int, hidden_mult: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(
            d_model,
            hidden_mult * d_model,
        )
        self.fc2 = nn.Linear(
            hidden_mult * d_model,
            d_model,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, d_model) -> (B, L, d_model)."""
        return self.fc2(F.gelu(self.fc1(x)))
