"""What the delta-rule mixers (DeltaNet, Gated DeltaNet) share: q, k and v projections, each
through an optional short convolution whose input and output are sites, in fla's names
(`q_conv1d`, ...), resumed from the convs' windows; and the floats they carry between tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mecheval.layers.short_conv import ShortConvolution
from mecheval.layers.sites import Site


class ShortConvQKV(nn.Module):
    """Base class. A subclass sets `q_proj`, `k_proj`, `v_proj`, `num_heads`, `head_k_dim`,
    `head_v_dim`, `key_dim`, `value_dim`, `use_short_conv` and `conv_size`, and calls
    `_add_convs` when it uses short convs."""

    @property
    def local_sites(self) -> tuple[str, ...]:
        """See mecheval.layers.sites: the convs' inputs are projections of one position."""
        return ("q_conv_input", "k_conv_input", "v_conv_input") if self.use_short_conv else ()

    @property
    def window_sites(self) -> dict[str, int]:
        """See mecheval.layers.sites: each conv's output reads conv_size inputs."""
        if not self.use_short_conv:
            return {}
        return {f"{x}_conv_output": self.conv_size for x in "qkv"}

    @property
    def readout_sites(self) -> dict[str, int]:
        """See mecheval.layers.sites: q reads the state out at its own position alone (through
        its conv: at the conv's width of positions)."""
        if not self.use_short_conv:
            return {}
        return {"q_conv_input": self.conv_size, "q_conv_output": 1}

    def _add_convs(self, conv_size: int, conv_bias: bool, qk_activation: str | None) -> None:
        """The three short convs (q and k with `qk_activation`, v with SiLU) and their sites."""
        self.q_conv1d = ShortConvolution(self.key_dim, conv_size, conv_bias, qk_activation)
        self.k_conv1d = ShortConvolution(self.key_dim, conv_size, conv_bias, qk_activation)
        self.v_conv1d = ShortConvolution(self.value_dim, conv_size, conv_bias, "silu")
        for name in ("q", "k", "v"):
            for end in ("input", "output"):
                self.add_module(f"{name}_conv_{end}", Site(f"{name}_conv_{end}"))

    def _conv(self, name: str, x: torch.Tensor, cache, keep: bool):
        x = getattr(self, f"{name}_conv_input")(x)
        x, final = getattr(self, f"{name}_conv1d")(x, cache, output_final_state=keep)
        return getattr(self, f"{name}_conv_output")(x), final

    def _qkv(self, hidden_states: torch.Tensor, windows: tuple, keep: bool, qk_silu: bool):
        """(q, k (B, L, H, K), v (B, L, H, V), the convs' last windows (None without convs or
        when not `keep`)). `windows`: the convs' windows to resume from (None: from the start);
        without convs, v goes through SiLU and q, k too when `qk_silu`."""
        batch, length, _ = hidden_states.shape
        q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        windows_out = (None,) * 3
        if self.use_short_conv:
            (q, q_out), (k, k_out), (v, v_out) = (
                self._conv(name, x, cache, keep)
                for name, x, cache in zip("qkv", (q, k, v), windows, strict=True)
            )
            windows_out = (q_out, k_out, v_out)
        else:
            if qk_silu:
                q, k = F.silu(q), F.silu(k)
            v = F.silu(v)
        H = self.num_heads
        q = q.view(batch, length, H, self.head_k_dim)
        k = k.view(batch, length, H, self.head_k_dim)
        return q, k, v.view(batch, length, H, self.head_v_dim), windows_out

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the state num_heads * head_k_dim * head_v_dim plus
        the short convs' last conv_size - 1 inputs. (zoology counts only the state.)"""
        window = self.conv_size - 1 if self.use_short_conv else 0
        return self.num_heads * self.head_k_dim * self.head_v_dim + window * (
            2 * self.key_dim + self.value_dim
        )
