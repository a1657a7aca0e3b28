"""Comba (Hu et al. 2025, "Improving Bilinear RNNs with Closed-loop Control"), following
flash-linear-attention's `fla.layers.Comba`: a delta rule whose recall key p reads the memory
before the decay (the transition exp(g_t) I - beta_t k_t p_t^T) and whose query is corrected by p.

Parameter names and shapes follow fla's layer (one value head per key head):

    q, k, v = silu(conv(u W_q)), silu(conv(u W_k)), silu(conv(u W_v))   short convs, width 4
    p = k * sigmoid(decay)        per head (use_inner_decay; else p = k)
    q <- q - D * p                per head (use_output_correction)
    q, k, p = q / |q|, k / |k|, p / |p|                                   per head, in the op
    g_t = -exp(A_log) * softplus(u_t W_a + dt_bias) ; beta_t = sigmoid(u_t W_b)
    u_t = beta_t (v_t - S_{t-1}^T p_t) ; S_t = exp(g_t) S_{t-1} + k_t u_t^T
    o_t = S_t^T q_t / sqrt(K)
    out = (rmsnorm(o) * w_norm * sigmoid(u W_g)) W_o                     gated RMSNorm per head

(As in fla's layer, the op normalises p, so the inner decay's per-head scale cancels: p is k's
direction.) The recurrence runs through `mecheval_kernels.chunk_comba` at positions. Not
supported from fla: `mode`, `num_v_heads` > num_heads, padding masks, caches.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import mecheval_kernels
from mecheval.layers.kda import SigmoidGatedRMSNorm, head_sizes
from mecheval.layers.qkv_convs import ShortConvQKV
from mecheval.layers.ssm_init import dt_bias, no_weight_decay


class Comba(ShortConvQKV):
    """Comba mixer.

    Sites (with short convs): `q_conv_input`, `q_conv_output`, `k_conv_input`, `k_conv_output`
    (B, L, key_dim), `v_conv_input`, `v_conv_output` (B, L, value_dim), each conv's input and
    output (after its SiLU); `state` (B, num_heads, head_dim, head_v_dim) float32, the state
    after a position.

    Args:
        hidden_size: channels in and out (`d_model` is an alias that wins when given).
        expand_v: head_v_dim = head_dim * expand_v (fla's default 2).
        head_dim: a head's key size K (key_dim = num_heads * head_dim).
        num_heads: heads.
        num_v_heads: fla's grouped value heads; only None or num_heads.
        use_short_conv: short convs (SiLU) on q, k, v; without, SiLU only.
        use_output_gate: output gate (g_proj) inside a sigmoid-gated RMSNorm; else RMSNorm.
        use_output_correction: q <- q - D p, D (num_heads,) from correction_factor.
        use_inner_decay: p = k * sigmoid(decay), decay (num_heads,); else p = k.
        correction_factor: D's initial value.
        conv_size: short conv width (1..8).
        conv_bias: whether the short convs have biases.
        layer_idx: index of the layer in its model (kept for reference).
        norm_eps: epsilon of the output norm.
        d_model: alias of hidden_size.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2.0,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        use_short_conv: bool = True,
        use_output_gate: bool = True,
        use_output_correction: bool = True,
        use_inner_decay: bool = True,
        correction_factor: float = 1.0,
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
        self.use_short_conv, self.conv_size, self.layer_idx = use_short_conv, conv_size, layer_idx
        self.use_output_gate, self.use_output_correction = use_output_gate, use_output_correction
        self.use_inner_decay, self.allow_neg_eigval = use_inner_decay, False

        self._add_qkv(hidden_size, num_heads, head_dim, head_v_dim)
        self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if use_inner_decay:
            self.decay = nn.Parameter(torch.ones(num_heads))
        if use_output_correction:
            self.D = no_weight_decay(torch.full((num_heads,), float(correction_factor)))
        self.A_log = no_weight_decay(torch.empty(num_heads).uniform_(0, 16).log())
        self.dt_bias = no_weight_decay(dt_bias(num_heads, 0.001, 0.1, 1e-4))
        if use_short_conv:
            self._add_convs(conv_size, conv_bias, "silu")
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = SigmoidGatedRMSNorm(head_v_dim, eps=norm_eps)
        else:
            self.o_norm = nn.RMSNorm(head_v_dim, eps=norm_eps)
        self._add_output()

    def scan_inputs(self, hidden_states, windows, state, resume) -> tuple:
        """See RecurrentMixer: Comba, with the recall key p and the corrected query."""
        q, k, v, windows = self._qkv(hidden_states, windows, resume, True)
        p = k * self.decay[:, None].sigmoid() if self.use_inner_decay else k
        if self.use_output_correction:
            q = q - self.D[:, None] * p
        g = self._decay(hidden_states)
        scan_at = functools.partial(
            mecheval_kernels.at_positions,
            mecheval_kernels.chunk_comba,
            q,
            k,
            v,
            p,
            g,
            self._beta(hidden_states),
            initial_state=state,
            use_qk_l2norm_in_kernel=True,
        )
        return scan_at, windows, hidden_states

    def output(self, o: torch.Tensor, hidden_states, at: torch.Tensor | None) -> torch.Tensor:
        """o: (B, T or 1, H, V)."""
        return self._gated_output(o, hidden_states, at, self.use_output_gate)
