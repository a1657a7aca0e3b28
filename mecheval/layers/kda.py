"""KDA (Kimi Delta Attention; Kimi Team 2025, "Kimi Linear"), following flash-linear-attention's
`fla.layers.KimiDeltaAttention`: the gated delta rule with a decay per key channel.

Parameter names and shapes follow fla's layer (one value head per key head):

    q, k, v = silu(conv(u W_q)), silu(conv(u W_k)), silu(conv(u W_v))   short convs, width 4
    q, k = q / |q|, k / |k|                                             per head
    g_t = -exp(A_log) * softplus(u_t F1 F2 + dt_bias)                    (H, K) log decays
    beta_t = sigmoid(u_t W_b)                                            (2 sigmoid: neg. eigval)
    S_t = diag(exp(g_t)) S_{t-1} + beta_t k_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t)^T
    o_t = S_t^T q_t / sqrt(K)
    out = (rmsnorm(o) * w_norm * sigmoid(u G1 G2 + b_g)) W_o              gated RMSNorm per head

With `lower_bound` the decay is lower_bound * sigmoid(exp(A_log) (u F1 F2 + dt_bias)) instead.
The recurrence runs through `mecheval_kernels.chunk_kda` at positions, the gate, beta's sigmoid
and q, k's normalisation inside it (as fla's layer asks its kernel). Not supported from fla:
`mode` (the kernel backend decides), `num_v_heads` > num_heads (grouped value heads), padding
masks, caches.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

import mecheval_kernels
from mecheval.layers.gated_delta_net import GatedRMSNorm
from mecheval.layers.qkv_convs import ShortConvQKV
from mecheval.layers.resume import pick
from mecheval.layers.ssm_init import dt_bias, no_weight_decay


class SigmoidGatedRMSNorm(GatedRMSNorm):
    """fla's `FusedRMSNormGated(activation="sigmoid")` in float32:
    x / rms(x) * weight * sigmoid(gate), over the last dimension."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """x, gate: (..., hidden_size) -> float32 (..., hidden_size)."""
        x = x.float()
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps) * self.weight
        return x * torch.sigmoid(gate.float())


def head_sizes(head_dim: int, expand_v: float, num_heads: int, num_v_heads: int | None) -> int:
    """head_v_dim = head_dim * expand_v, checked (a positive integer; no grouped value heads)."""
    head_v_dim = head_dim * expand_v
    if not math.isclose(head_v_dim, round(head_v_dim), rel_tol=1e-5) or head_v_dim < 1:
        raise ValueError(
            f"expand_v {expand_v} times head_dim {head_dim} must be a positive integer"
        )
    if head_dim < 1 or num_heads < 1:
        raise ValueError(f"head_dim and num_heads must be >= 1, got {head_dim}, {num_heads}")
    if num_v_heads not in (None, num_heads):
        raise ValueError(
            f"num_v_heads {num_v_heads} != num_heads {num_heads}: grouped value heads (GVA) are "
            "not supported by mecheval's layer (the kernels take them)"
        )
    return int(round(head_v_dim))


class KDA(ShortConvQKV):
    """KDA mixer.

    Sites (with short convs): `q_conv_input`, `q_conv_output`, `k_conv_input`, `k_conv_output`
    (B, L, key_dim), `v_conv_input`, `v_conv_output` (B, L, value_dim), each conv's input and
    output (after its SiLU); `state` (B, num_heads, head_dim, head_v_dim) float32, the state
    after a position.

    Args:
        hidden_size: channels in and out (`d_model` is an alias that wins when given).
        expand_v: head_v_dim = head_dim * expand_v (fla's default 1).
        head_dim: a head's key size K (key_dim = num_heads * head_dim).
        num_heads: heads (each with its decays per key channel and write strength).
        num_v_heads: fla's grouped value heads; only None or num_heads.
        use_short_conv: short convs (SiLU) on q, k, v; without, SiLU only.
        allow_neg_eigval: beta in (0, 2) instead of (0, 1).
        safe_gate: fla's bounded-gate mode: A_log starts at 0, and lower_bound is required.
        lower_bound: the decays' lower bound (log space), in [-5, 0) with safe_gate.
        conv_size: short conv width (1..8).
        conv_bias: whether the short convs have biases.
        layer_idx: index of the layer in its model (kept for reference).
        norm_eps: epsilon of the output norm.
        d_model: alias of hidden_size.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 1.0,
        head_dim: int = 128,
        num_heads: int = 16,
        num_v_heads: int | None = None,
        use_short_conv: bool = True,
        allow_neg_eigval: bool = False,
        safe_gate: bool = False,
        lower_bound: float | None = None,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        d_model: int | None = None,
    ) -> None:
        super().__init__()
        if d_model is not None:
            hidden_size = d_model
        head_v_dim = head_sizes(head_dim, expand_v, num_heads, num_v_heads)
        if safe_gate and (lower_bound is None or not -5 <= lower_bound < 0):
            raise ValueError(f"safe_gate needs lower_bound in [-5, 0), got {lower_bound}")
        self.use_short_conv, self.conv_size, self.layer_idx = use_short_conv, conv_size, layer_idx
        self.allow_neg_eigval, self.safe_gate, self.lower_bound = (
            allow_neg_eigval, safe_gate, lower_bound)  # fmt: skip

        self._add_qkv(hidden_size, num_heads, head_dim, head_v_dim)
        # A low-rank map to the (H, K) decays, as fla's f_proj.
        self.f_proj = nn.Sequential(
            nn.Linear(hidden_size, head_v_dim, bias=False),
            nn.Linear(head_v_dim, self.key_dim, bias=False),
        )
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        # fla's init: A ~ U(1, 16) (0 with safe_gate), softplus(dt_bias) log-uniform.
        A_log = (
            torch.zeros(num_heads) if safe_gate else torch.empty(num_heads).uniform_(1, 16).log()
        )
        self.A_log = no_weight_decay(A_log)
        self.dt_bias = no_weight_decay(dt_bias(self.key_dim, 0.001, 0.1, 1e-4))
        if use_short_conv:
            self._add_convs(conv_size, conv_bias, "silu")
        self.g_proj = nn.Sequential(
            nn.Linear(hidden_size, head_v_dim, bias=False),
            nn.Linear(head_v_dim, self.value_dim, bias=True),
        )
        self.o_norm = SigmoidGatedRMSNorm(head_v_dim, eps=norm_eps)
        self._add_output()

    def scan_inputs(self, hidden_states, windows, state, resume) -> tuple:
        """See RecurrentMixer: KDA; the gate, beta's sigmoid and the norms run in the op."""
        q, k, v, windows = self._qkv(hidden_states, windows, resume, True)
        gate = self.f_proj(hidden_states).unflatten(-1, (self.num_heads, self.head_k_dim))
        scan_at = functools.partial(
            mecheval_kernels.at_positions,
            mecheval_kernels.chunk_kda,
            q,
            k,
            v,
            gate,
            self.b_proj(hidden_states),
            initial_state=state,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=self.allow_neg_eigval,
            safe_gate=self.safe_gate,
            lower_bound=self.lower_bound,
            A_log=self.A_log,
            dt_bias=self.dt_bias,
        )
        return scan_at, windows, hidden_states

    def output(self, o: torch.Tensor, hidden_states, at: torch.Tensor | None) -> torch.Tensor:
        """o: (B, T or 1, H, V)."""
        gate = self.g_proj(pick(hidden_states, at))
        o = self.o_norm(o, gate.unflatten(-1, (self.num_heads, self.head_v_dim)))
        return self.o_proj(o.flatten(-2))
