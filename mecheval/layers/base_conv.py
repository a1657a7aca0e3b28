"""BaseConv: a convolution gated by a linear projection (Arora et al. 2023, "Zoology").

    y = conv(u) * (u W) + u

where conv is a short causal depthwise convolution (width W, with bias, on
`mecheval_kernels.causal_conv1d_fn`) or an implicit long convolution (`ImplicitLongConvolution`,
which itself adds u back), and the projection W has a bias, as zoology builds them.
"""

from __future__ import annotations

import torch
from torch import nn

from mecheval.layers.long_conv import ImplicitLongConvolution
from mecheval.layers.mixer import Mixer
from mecheval.layers.resume import Resume, leave_context, resumed_from
from mecheval.layers.short_conv import ShortConvolution


class BaseConv(Mixer):
    """Gated convolution.

    Sites: a short conv exposes `conv_input` / `conv_output` (B, L, d_model); a long conv
    `long_conv_input` / `long_conv_output`.

    Args:
        d_model: channels in and out.
        l_max: the sizing length of the long conv's filter (sequences up to l_max).
        kernel_size: short conv width (1..8), or -1 for the implicit long convolution.
        filter_order: width of the long conv's filter MLP.
    """

    def __init__(
        self, d_model: int, l_max: int, kernel_size: int = 3, filter_order: int = 16
    ) -> None:
        super().__init__()
        self.d_model, self.l_max, self.kernel_size = d_model, l_max, kernel_size
        self.projection = nn.Linear(d_model, d_model)
        if kernel_size == -1:
            self.conv = ImplicitLongConvolution(d_model, l_max, order=filter_order)
            prefix = "long_conv"
        else:
            self.conv = ShortConvolution(d_model, kernel_size, bias=True, activation=None)
            prefix = "conv"
        # Registered under their site names, so module paths match site names.
        self._site_names = (f"{prefix}_input", f"{prefix}_output")
        self.add_sites(*self._site_names)

    # Context: the short conv's last W - 1 inputs (B, d, W - 1), or every past input of the long
    # conv (B, P, d).
    resumable = True

    @property
    def local_sites(self) -> tuple[str, ...]:
        """See mecheval.layers.mixer: the conv's input is the mixer's input."""
        return self._site_names[:1]

    @property
    def conv_sites(self) -> tuple[str, ...]:
        """See mecheval.layers.mixer: the short conv's output (the long conv is none)."""
        return () if self.is_long else self._site_names[1:]

    @property
    def reach_site(self) -> str:
        """See mecheval.layers.mixer: only the conv reads other positions."""
        return self._site_names[0]

    @property
    def readout_sites(self) -> dict[str, int]:
        """See mecheval.layers.mixer: the conv's output is gated at its own position."""
        return {self._site_names[1]: 1}

    @property
    def is_long(self) -> bool:
        return self.kernel_size == -1

    def forward(self, u: torch.Tensor, resume: Resume | None = None) -> torch.Tensor:
        """u: (B, L, d_model) -> (B, L, d_model)."""
        site_in, site_out = (getattr(self, name) for name in self._site_names)
        (before,) = resumed_from(resume, 1)
        c = site_in(u)
        if self.is_long:
            c, context = self.conv(c, before)
        else:
            c, context = self.conv(c, cache=before, output_final_state=resume is not None)
        leave_context(resume, context)
        c = site_out(c)
        return c * self.projection(u) + u

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the last W - 1 inputs, or every past input."""
        if self.is_long:
            return self.d_model * sequence_length
        return self.d_model * (self.kernel_size - 1)
