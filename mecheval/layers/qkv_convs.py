"""What the delta-rule mixers (DeltaNet, Gated DeltaNet) share: q, k and v projections, each
through an optional short convolution whose input and output are sites, in fla's names
(`q_conv1d`, ...), resumed from the convs' windows; and the floats they carry between tokens."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from mecheval.layers.recurrent import RecurrentMixer
from mecheval.layers.resume import Resume


class ShortConvQKV(RecurrentMixer):
    """Base class. A subclass sets `q_proj`, `k_proj`, `v_proj`, `num_heads`, `head_k_dim`,
    `head_v_dim`, `key_dim`, `value_dim`, `use_short_conv` and `conv_size`, and calls
    `_add_convs` when it uses short convs."""

    # Contexts come from a base run in segments: reading the states at the resume points in one
    # pass costs more than the segments (DeltaNet's named grid 4.64 -> 5.01 s, Gated DeltaNet
    # 5.76 -> 6.00 s, benchmarks/grid_speedups.py setup, one thread).
    context_sites = None

    @property
    def readout_sites(self) -> Mapping[str, int]:
        """See mecheval.layers.mixer: q reads the state out at its own position alone (through
        its conv: at the conv's width of positions)."""
        if not self.use_short_conv:
            return {}
        return {"q_conv_input": self.conv_size, "q_conv_output": 1}

    def _add_convs(self, conv_size: int, conv_bias: bool, qk_activation: str | None) -> None:
        """The three short convs (q and k with `qk_activation`, v with SiLU) and their sites."""
        channels = {
            "q_conv": (self.key_dim, qk_activation),
            "k_conv": (self.key_dim, qk_activation),
            "v_conv": (self.value_dim, "silu"),
        }
        self.add_convs("conv_size", conv_size, conv_bias, channels)

    def _qkv(self, hidden_states: torch.Tensor, windows: tuple, resume: Resume | None, qk_silu):
        """(q, k (B, L, H, K), v (B, L, H, V), the convs' last windows (empty without convs,
        None entries when no context is to be left)). `windows`: the convs' windows to resume
        from (None: from the start); without convs, v goes through SiLU and q, k too when
        `qk_silu`."""
        batch, length, _ = hidden_states.shape
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        (q, k, v), windows = self.short_convs((q, k, v), windows, resume, (qk_silu, qk_silu, True))
        H = self.num_heads
        q = q.view(batch, length, H, self.head_k_dim)
        k = k.view(batch, length, H, self.head_k_dim)
        return q, k, v.view(batch, length, H, self.head_v_dim), windows

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the state num_heads * head_k_dim * head_v_dim plus
        the short convs' last conv_size - 1 inputs. (zoology counts only the state.)"""
        window = self.conv_size - 1 if self.use_short_conv else 0
        return self.num_heads * self.head_k_dim * self.head_v_dim + window * (
            2 * self.key_dim + self.value_dim
        )
