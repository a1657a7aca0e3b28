"""A mixer of one's own with short convolutions on q, k and v under site names the zoo does not
use (`q_short`, `k_short`, `v_short`), declared in `conv_sites`: causal linear attention,
o_t = sum_{s <= t} (q_t . k_s) v_s / t. Named by import path in the tests:
`tests.evaluation.conv_mixer:ShortConvAttention`."""

from __future__ import annotations

import torch
from torch import nn

from mecheval.layers import Mixer
from mecheval.layers.short_conv import ShortConvolution


class ShortConvAttention(Mixer):
    conv_sites = ("q_short", "k_short", "v_short")

    def __init__(self, d_model: int, width: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, 3 * d_model, bias=False)
        self.convs = nn.ModuleList(
            ShortConvolution(d_model, width, activation=None) for _ in range(3)
        )
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.add_sites(*self.conv_sites)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.proj(x).chunk(3, -1)
        q, k, v = (
            getattr(self, name)(conv(part)[0])
            for name, conv, part in zip(self.conv_sites, self.convs, parts, strict=True)
        )
        scores = (q @ k.transpose(1, 2)).tril()
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[:, None]
        return self.out(scores @ v / steps)
