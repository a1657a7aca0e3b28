"""Gated DeltaProduct (Siems et al. 2025, "DeltaProduct: Improving State-Tracking in Linear RNNs
via Householder Products"), following flash-linear-attention's `fla.layers.GatedDeltaProduct`:
n = num_householder delta-rule steps a token.

Parameter names and shapes follow fla's layer (one value head per key head):

    q = silu(conv(u W_q)) ; k_1..k_n = silu(conv(u W_k)) ; v_1..v_n = silu(conv(u W_v))
    q, k_j = q / |q|, k_j / |k_j|                                 per head
    g_t = -exp(A_log) * softplus(u_t W_a + dt_bias)               log decay, per head (forget gate)
    beta_{t,j} = sigmoid(u_t W_b)_j                               (2 sigmoid: allow_neg_eigval)
    S <- exp(g_t) S ; S <- S + beta_{t,j} k_j (v_j - S^T k_j)^T for j = 1..n
    o_t = S^T q_t / sqrt(K)
    out = (rmsnorm(o) * w_norm * silu(u W_g)) W_o                 gated RMSNorm (use_output_gate)

W_k, W_v and their convs produce the n keys and values of a token side by side (fla's layout:
step-major, then heads). The recurrence runs through `mecheval_kernels.chunk_gated_delta_product`
at positions (positions are tokens: the state after a token's last step). Not supported from
fla: `mode`, `num_v_heads` > num_heads, padding masks, caches.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import mecheval_kernels
from mecheval.checks import check_int
from mecheval.layers.gated_delta_net import GatedRMSNorm
from mecheval.layers.kda import head_sizes
from mecheval.layers.qkv_convs import ShortConvQKV
from mecheval.layers.ssm_init import dt_bias, no_weight_decay


class GatedDeltaProduct(ShortConvQKV):
    """Gated DeltaProduct mixer.

    Sites (with short convs): `q_conv_input`, `q_conv_output` (B, L, key_dim), `k_conv_input`,
    `k_conv_output` (B, L, num_householder * key_dim), `v_conv_input`, `v_conv_output`
    (B, L, num_householder * value_dim), each conv's input and output (after its SiLU);
    `state` (B, num_heads, head_dim, head_v_dim) float32, the state after a token.

    Args:
        hidden_size: channels in and out (`d_model` is an alias that wins when given).
        expand_v: head_v_dim = head_dim * expand_v (fla's default 2).
        head_dim: a head's key size K (key_dim = num_heads * head_dim).
        num_heads: heads.
        num_v_heads: fla's grouped value heads; only None or num_heads.
        use_output_gate: output gate (g_proj) inside a gated RMSNorm; else a plain RMSNorm.
        use_short_conv: short convs (SiLU) on q, k, v; without, SiLU only.
        conv_size: short conv width (1..8).
        conv_bias: whether the short convs have biases.
        layer_idx: index of the layer in its model (kept for reference).
        norm_eps: epsilon of the output norm.
        use_forget_gate: the decay g (a_proj, A_log, dt_bias); without, no decay.
        allow_neg_eigval: beta in (0, 2) instead of (0, 1) (fla's default True).
        num_householder: n, the delta-rule steps a token.
        d_model: alias of hidden_size.
    """

    def __init__(
        self,
        hidden_size: int = 2048,
        expand_v: float = 2.0,
        head_dim: int = 256,
        num_heads: int = 6,
        num_v_heads: int | None = None,
        use_output_gate: bool = True,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        layer_idx: int | None = None,
        norm_eps: float = 1e-5,
        use_forget_gate: bool = True,
        allow_neg_eigval: bool = True,
        num_householder: int = 2,
        d_model: int | None = None,
    ) -> None:
        super().__init__()
        if d_model is not None:
            hidden_size = d_model
        head_v_dim = head_sizes(head_dim, expand_v, num_heads, num_v_heads)
        n = self.num_householder = check_int("num_householder", num_householder, 1)
        self.use_output_gate, self.use_forget_gate = use_output_gate, use_forget_gate
        self.use_short_conv, self.conv_size, self.layer_idx = use_short_conv, conv_size, layer_idx
        self.allow_neg_eigval = allow_neg_eigval

        self._add_qkv(hidden_size, num_heads, head_dim, head_v_dim)
        self.k_proj = nn.Linear(hidden_size, n * self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, n * self.value_dim, bias=False)
        self.b_proj = nn.Linear(hidden_size, n * num_heads, bias=False)
        if use_forget_gate:
            self.a_proj = nn.Linear(hidden_size, num_heads, bias=False)
            self.A_log = no_weight_decay(torch.empty(num_heads).uniform_(0, 16).log())
            self.dt_bias = no_weight_decay(dt_bias(num_heads, 0.001, 0.1, 1e-4))
        if use_short_conv:
            channels = {"q_conv": (self.key_dim, "silu"), "k_conv": (n * self.key_dim, "silu"),
                        "v_conv": (n * self.value_dim, "silu")}  # fmt: skip
            self.add_convs("conv_size", conv_size, conv_bias, channels)
        if use_output_gate:
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.o_norm = GatedRMSNorm(head_v_dim, eps=norm_eps)
        else:
            self.o_norm = nn.RMSNorm(head_v_dim, eps=norm_eps)
        self._add_output()

    def scan_inputs(self, hidden_states, windows, state, resume) -> tuple:
        """See RecurrentMixer: n delta-rule steps a token."""
        B, L, _ = hidden_states.shape
        n, H, K, V = self.num_householder, self.num_heads, self.head_k_dim, self.head_v_dim
        projected = (self.q_proj(hidden_states), self.k_proj(hidden_states),
                     self.v_proj(hidden_states))  # fmt: skip
        (q, k, v), windows = self.short_convs(projected, windows, resume)
        beta = self.b_proj(hidden_states).sigmoid()
        g = None
        if self.use_forget_gate:
            g = self._decay(hidden_states)
        scan_at = functools.partial(
            mecheval_kernels.at_positions,
            mecheval_kernels.chunk_gated_delta_product,
            q.view(B, L, H, K),
            k.reshape(B, L * n, H, K),  # token t's step j at row t n + j
            v.reshape(B, L * n, H, V),
            g,
            (beta * 2 if self.allow_neg_eigval else beta).reshape(B, L * n, H),
            n,
            initial_state=state,
            use_qk_l2norm_in_kernel=True,
        )
        return scan_at, windows, hidden_states

    def output(self, o: torch.Tensor, hidden_states, at: torch.Tensor | None) -> torch.Tensor:
        """o: (B, T or 1, H, V)."""
        return self._gated_output(o, hidden_states, at, self.use_output_gate)

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the state plus the short convs' last conv_size - 1
        inputs (n keys and values a token)."""
        window = self.conv_size - 1 if self.use_short_conv else 0
        n = self.num_householder
        channels = self.key_dim + n * (self.key_dim + self.value_dim)
        return self.num_heads * self.head_k_dim * self.head_v_dim + window * channels
