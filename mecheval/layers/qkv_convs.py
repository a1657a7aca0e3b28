"""What the delta-rule mixers (DeltaNet, Gated DeltaNet) share: q, k and v projections, each
through an optional short convolution whose input and output are sites, in fla's names
(`q_conv1d`, ...), resumed from the convs' windows; the write strengths beta; the output
projection; and the floats they carry between tokens."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from mecheval.layers.recurrent import RecurrentMixer
from mecheval.layers.resume import Resume, pick
from mecheval.layers.sites import StateSite


class ShortConvQKV(RecurrentMixer):
    """Base class. A subclass sets `use_short_conv`, `conv_size` and `allow_neg_eigval`
    (`use_beta` too, if it may go without b_proj), and in its constructor calls `_add_qkv`,
    `_add_convs` when it uses short convs, and `_add_output` last."""

    use_beta: bool = True

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

    def _add_qkv(self, hidden_size: int, num_heads: int, head_k_dim: int, head_v_dim: int):
        """The sizes, and the q, k, v projections (no bias) of `num_heads` heads of head_k_dim
        keys and head_v_dim values."""
        self.hidden_size, self.num_heads = hidden_size, num_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_heads * head_k_dim, num_heads * head_v_dim
        self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)

    def _add_output(self) -> None:
        """The output projection `o_proj` (no bias) and the state site."""
        self.o_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)
        self.state = StateSite("state")

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

    def _beta(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The write strengths (B, L, num_heads): sigmoid(u W_b) (ones without `use_beta`),
        doubled with `allow_neg_eigval`."""
        if self.use_beta:
            beta = self.b_proj(hidden_states).sigmoid()
        else:
            beta = hidden_states.new_ones(*hidden_states.shape[:2], self.num_heads)
        return beta * 2 if self.allow_neg_eigval else beta

    def _decay(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The gated delta rules' log decays (B, L, num_heads), in float32 as fla forms them:
        -exp(A_log) softplus(u W_a + dt_bias)."""
        step = self.a_proj(hidden_states).float() + self.dt_bias.float()
        return -self.A_log.float().exp() * F.softplus(step)

    def _gated_output(self, o: torch.Tensor, hidden_states, at, gated: bool) -> torch.Tensor:
        """o_proj of o (B, T or 1, H, V) normed by o_norm: gated by g_proj of the input at
        `at` (gated), or alone in the norm's weight's dtype."""
        if gated:
            gate = self.g_proj(pick(hidden_states, at))
            o = self.o_norm(o, gate.unflatten(-1, (self.num_heads, self.head_v_dim)))
        else:
            o = self.o_norm(o.to(self.o_norm.weight.dtype))
        return self.o_proj(o.flatten(-2))

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the state num_heads * head_k_dim * head_v_dim plus
        the short convs' last conv_size - 1 inputs. (zoology counts only the state.)"""
        window = self.conv_size - 1 if self.use_short_conv else 0
        return self.num_heads * self.head_k_dim * self.head_v_dim + window * (
            2 * self.key_dim + self.value_dim
        )
