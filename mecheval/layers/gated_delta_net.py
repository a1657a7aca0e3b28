"""Gated DeltaNet (Yang et al. 2024, "Gated Delta Networks: Improving Mamba2 with Delta Rule"),
following flash-linear-attention's layer.

Parameter names and shapes follow `fla.layers.GatedDeltaNet` (one value head per key head):

    q, k, v = silu(conv(u W_q)), silu(conv(u W_k)), silu(conv(u W_v))   short convs, width 4
    q, k = q / |q|, k / |k|                                             per head
    g_t = -exp(A_log) * softplus(u_t W_a + dt_bias)                      log decay, per head
    beta_t = sigmoid(u_t W_b)                                            write strength, per head
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T    S_t (K, V) per head
    o_t = S_t^T q_t / sqrt(K)
    out = (rmsnorm(o) * w_norm * silu(u W_g)) W_o          gated RMSNorm per head (use_gate)

The recurrence runs through `mecheval_kernels.chunk_gated_delta_rule` at positions (q and k
normalised inside it; mecheval_kernels.at_positions). Not supported from fla: `mode` (the kernel
backend decides), `num_v_heads` > num_heads (grouped value heads), padding masks, caches.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

import mecheval_kernels
from mecheval.layers.qkv_convs import ShortConvQKV
from mecheval.layers.resume import pick
from mecheval.layers.ssm_init import dt_bias, no_weight_decay


class GatedRMSNorm(nn.Module):
    """fla's `FusedRMSNormGated` (swish gate, norm before the gate), in float32:
    x / rms(x) * weight * silu(gate), over the last dimension.

    Args:
        hidden_size: the normalised dimension (a head's value size).
        eps: added to the mean square.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: (..., hidden_size) -> float32 (..., hidden_size)."""
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight
        return x * F.silu(gate.float())


class GatedDeltaNet(ShortConvQKV):
    """Gated DeltaNet mixer.

    Sites (with short convs): `q_conv_input`, `q_conv_output`, `k_conv_input`, `k_conv_output`
    (B, L, key_dim), `v_conv_input`, `v_conv_output` (B, L, value_dim), each conv's input and
    output (after its SiLU); `state` (B, num_heads, head_dim, head_v_dim) float32, the state
    after a position.

    Args:
        hidden_size: channels in and out (`d_model` is an alias that wins when given).
        expand_v: head_v_dim = head_dim * expand_v (fla's default 2; the zoo's models use 1).
        head_dim: a head's key size K (key_dim = num_heads * head_dim).
        num_heads: heads (each with its own decay and write strength).
        use_gate: output gate (g_proj) inside a gated RMSNorm; else a plain RMSNorm.
        use_short_conv: short convs (SiLU) on q, k, v; without, SiLU only.
        allow_neg_eigval: beta in (0, 2) instead of (0, 1).
        conv_size: short conv width (1..8).
        conv_bias: whether the short convs have biases.
        layer_idx: index of the layer in its model (kept for reference).
        norm_eps: epsilon of the output norm.
        dt_min, dt_max, dt_init_floor: range of the initial softplus(dt_bias), as fla's.
        d_model: alias of hidden_size.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2.0,
        head_dim: int = 256,
        num_heads: int = 6,
        use_gate: bool = True,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        dt_min: float = 0.001,
        dt_max: float = 0.1,
        dt_init_floor: float = 1e-4,
        d_model: int | None = None,
    ) -> None:
        super().__init__()
        if d_model is not None:
            hidden_size = d_model
        head_v_dim = head_dim * expand_v
        if not math.isclose(head_v_dim, round(head_v_dim), rel_tol=1e-5) or head_v_dim < 1:
            raise ValueError(
                f"expand_v {expand_v} times head_dim {head_dim} must be a positive integer"
            )
        if head_dim < 1 or num_heads < 1:
            raise ValueError(f"head_dim and num_heads must be >= 1, got {head_dim}, {num_heads}")
        self.use_gate, self.use_short_conv, self.conv_size = use_gate, use_short_conv, conv_size
        self.allow_neg_eigval, self.layer_idx = allow_neg_eigval, layer_idx

        self._add_qkv(hidden_size, num_heads, head_dim, int(round(head_v_dim)))
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        # fla's init: decay rates A ~ U(0, 16), softplus(dt_bias) log-uniform in [dt_min, dt_max].
        self.A_log = no_weight_decay(torch.empty(num_heads).uniform_(0, 16).log())
        self.dt_bias = no_weight_decay(dt_bias(num_heads, dt_min, dt_max, dt_init_floor))
        if use_short_conv:
            self._add_convs(conv_size, conv_bias, "silu")
        if use_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps)
        else:
            self.o_norm = nn.RMSNorm(self.head_v_dim, eps=norm_eps)
        self._add_output()

    def scan_inputs(self, hidden_states, windows, state, resume) -> tuple:
        """See RecurrentMixer: the gated delta rule; the output gate reads the input (aside)."""
        q, k, v, windows = self._qkv(hidden_states, windows, resume, True)
        g = self._decay(hidden_states)
        scan_at = functools.partial(
            mecheval_kernels.at_positions,
            mecheval_kernels.chunk_gated_delta_rule,
            q,
            k,
            v,
            g,
            self._beta(hidden_states),
            initial_state=state,
            use_qk_l2norm_in_kernel=True,
        )
        return scan_at, windows, hidden_states

    def output(self, o: torch.Tensor, hidden_states, at: torch.Tensor | None) -> torch.Tensor:
        """o: (B, T or 1, H, V)."""
        # In float32: the kernel returns q's dtype (bf16 under autocast), the norm's weight is
        # float32 (a mixed-dtype RMSNorm falls off its fused path with a warning).
        if self.use_gate:
            gate = self.g_proj(pick(hidden_states, at))
            o = self.o_norm(o, gate.unflatten(-1, (self.num_heads, self.head_v_dim)))
        else:
            o = self.o_norm(o.float())
        return self.o_proj(o.flatten(-2))
