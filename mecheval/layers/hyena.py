"""Hyena operator of order 2 (Poli et al. 2023), as zoology's `Hyena` builds it.

x1, x2, v = split(short_conv(u W_in + b_in))  short filter width 3 (with bias) over 3 d channels
v = v * x1                                    pre-gating
v = h * v + D v                               implicit long filter h, skip D (off: see below)
y = (v * x2) W_out + b_out                    post-gating, output projection
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import nn

from mecheval.layers.long_conv import ImplicitFilter, resumed_long_conv
from mecheval.layers.mixer import Mixer
from mecheval.layers.resume import Resume, conv_window, leave_context, pick, resumed_from
from mecheval.layers.short_conv import ShortConvolution


class Hyena(Mixer):
    """Hyena mixer.

    Sites: `conv_input` / `conv_output` (B, L, 3 d_model), the short filter's input and output;
    `long_conv_input` / `long_conv_output` (B, L, d_model), the gated v before and after the
    long convolution (skip included).

    Args:
        d_model: channels in and out.
        l_max: the sizing length of the implicit filter (sequences up to l_max).
        filter_order: width of the implicit filter's MLP.
        short_filter_order: width of the short filter.
        use_skip: apply the skip D of the long convolution. zoology calls D the filter's
            "bias" and multiplies it by 0 when built with bias=False, as the study's models
            are, so the default is off; D is a parameter either way (the study's models have
            it, untrained).
    """

    def __init__(
        self,
        d_model: int,
        l_max: int,
        filter_order: int = 64,
        short_filter_order: int = 3,
        use_skip: bool = False,
    ) -> None:
        super().__init__()
        self.d_model, self.l_max = d_model, l_max
        self.use_skip = use_skip
        self.in_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.short_filter = ShortConvolution(
            3 * d_model, short_filter_order, bias=True, activation=None
        )
        self.filter_fn = ImplicitFilter(d_model, l_max, order=filter_order)
        self.D = nn.Parameter(torch.randn(d_model))
        self.add_sites("conv_input", "conv_output", "long_conv_input", "long_conv_output")

    # Declarations (mecheval.layers.mixer). Context: the short filter's last inputs
    # (B, 3 d, W - 1) and every past input of the long convolution (B, P, d).
    resumable = True
    reads_out_at = True
    local_sites = ("conv_input",)  # in_proj of one position
    conv_sites = ("conv_output",)  # the short filter's
    reach_site = "conv_input"  # the mixer's input is read by in_proj alone
    readout_sites = MappingProxyType({"long_conv_output": 1})  # gated by x2 at its position
    context_sites = ("conv_input", "long_conv_input")

    @property
    def window_sites(self) -> dict[str, int]:
        """See mecheval.layers.mixer: the short filter's output reads its width of inputs."""
        return {"conv_output": self.short_filter.kernel_size[0]}

    def context_from(self, values: dict, point: int, index: int) -> tuple:
        """See mecheval.layers.mixer: the short filter's window and the long conv's inputs."""
        width = self.short_filter.kernel_size[0]
        return conv_window(values["conv_input"], point, width), values["long_conv_input"][:, :point]

    def forward(
        self, u: torch.Tensor, resume: Resume | None = None, at: torch.Tensor | None = None
    ) -> torch.Tensor:
        """u: (B, L, d_model) -> (B, L, d_model), or (B, 1, d_model) at positions `at` (B,)."""
        d = self.d_model
        window, before = resumed_from(resume, 2)
        p = self.conv_input(self.in_proj(u))
        p, window = self.short_filter(p, cache=window, output_final_state=resume is not None)
        p = self.conv_output(p)
        x1, x2, v = p.split(d, dim=-1)
        v = self.long_conv_input(v * x1)
        read = at if self.long_conv_output.idle else None  # else every position, then picked
        y, inputs = resumed_long_conv(v, before, self.filter_fn, read)
        leave_context(resume, window, inputs)
        v, x2 = pick(v, read), pick(x2, read)
        v = self.long_conv_output(y + v * self.D if self.use_skip else y)
        out = self.out_proj(v * x2)
        return out if read is not None else pick(out, at)

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: every past input of the long convolution and the
        short filter's window."""
        window = self.short_filter.kernel_size[0] - 1
        return self.d_model * sequence_length + 3 * self.d_model * window
