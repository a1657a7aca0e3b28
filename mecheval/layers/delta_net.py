"""DeltaNet (Schlag et al. 2021; Yang et al. 2024), following flash-linear-attention's layer.

Parameter names and options follow `fla.layers.DeltaNet` where they overlap:

    q, k, v = act(conv(u W_q)), act(conv(u W_k)), silu(conv(u W_v))   short convs, width 4
    q, k = q / |q|, k / |k|                                              per head ("l2")
    beta_t = sigmoid(u_t W_b)                                            one per head
    S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T                   S_t (K, V) per head
    o_t = rmsnorm(S_t^T q_t / sqrt(K)) ;  out = o W_o

The delta rule runs through `mecheval_kernels.chunk_delta_rule` at positions (q and k normalised
inside the kernel; mecheval_kernels.at_positions). Not supported from fla: `mode` (the kernel
backend decides), `use_gate`, padding masks, caches.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import mecheval_kernels
from mecheval.layers.qkv_convs import ShortConvQKV

QK_ACTIVATIONS = ("silu", "relu", "elu", "identity")
QK_NORMS = ("l2", "sum")


class DeltaNet(ShortConvQKV):
    """DeltaNet mixer.

    Sites (with short convs): `q_conv_input`, `q_conv_output`, `k_conv_input`, `k_conv_output`
    (B, L, key_dim), `v_conv_input`, `v_conv_output` (B, L, value_dim), each conv's input and
    output (after its activation); `state` (B, num_heads, head_k_dim, head_v_dim) float32,
    the fast-weight state after a position.

    Args:
        hidden_size: channels in and out (`d_model` is an alias that wins when given).
        expand_k: key_dim = hidden_size * expand_k.
        expand_v: value_dim = hidden_size * expand_v.
        num_heads: heads; key_dim and value_dim must divide by it.
        use_beta: learn beta_t = sigmoid(u_t W_b); else beta = 1.
        use_short_conv: short convs on q, k, v; without, activations only.
        conv_size: short conv width (1..8).
        conv_bias: whether the short convs have biases.
        allow_neg_eigval: beta in (0, 2) instead of (0, 1).
        layer_idx: index of the layer in its model (kept for reference).
        qk_activation: "silu" (fused into the q/k convs), "relu", "elu" (elu + 1) or "identity".
        qk_norm: "l2" (unit q, k) or "sum" (q, k divided by their sums).
        norm_eps: epsilon of the output RMSNorm.
        d_model: alias of hidden_size.
    """

    def __init__(
        self,
        hidden_size: int = 1024,
        expand_k: float = 1.0,
        expand_v: float = 1.0,
        num_heads: int = 4,
        use_beta: bool = True,
        use_short_conv: bool = True,
        conv_size: int = 4,
        conv_bias: bool = False,
        allow_neg_eigval: bool = False,
        layer_idx: int | None = None,
        qk_activation: str = "silu",
        qk_norm: str = "l2",
        norm_eps: float = 1e-5,
        d_model: int | None = None,
    ) -> None:
        super().__init__()
        if qk_activation not in QK_ACTIVATIONS:
            raise ValueError(f"qk_activation must be one of {QK_ACTIVATIONS}, got {qk_activation}")
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm must be one of {QK_NORMS}, got {qk_norm!r}")
        if d_model is not None:
            hidden_size = d_model
        key_dim, value_dim = int(hidden_size * expand_k), int(hidden_size * expand_v)
        if key_dim % num_heads or value_dim % num_heads:
            raise ValueError(
                f"key_dim {key_dim} and value_dim {value_dim} must be divisible by "
                f"num_heads {num_heads}"
            )
        self.use_beta, self.use_short_conv, self.conv_size = use_beta, use_short_conv, conv_size
        self.allow_neg_eigval, self.layer_idx = allow_neg_eigval, layer_idx
        self.qk_activation, self.qk_norm = qk_activation, qk_norm

        self._add_qkv(hidden_size, num_heads, key_dim // num_heads, value_dim // num_heads)
        if use_beta:
            self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        if use_short_conv:
            self._add_convs(conv_size, conv_bias, "silu" if qk_activation == "silu" else None)
        self.o_norm = nn.RMSNorm(self.head_v_dim, eps=norm_eps)
        self._add_output()

    def scan_inputs(self, hidden_states, windows, state, resume) -> tuple:
        """See RecurrentMixer: the delta rule on the (activated) q, k, v."""
        q, k, v, windows = self._qkv(hidden_states, windows, resume, self.qk_activation == "silu")
        if self.qk_activation == "relu":
            q, k = q.relu(), k.relu()
        elif self.qk_activation == "elu":
            q, k = F.elu(q) + 1, F.elu(k) + 1
        if self.qk_norm == "sum":
            q, k = q / q.sum(-1, keepdim=True), k / k.sum(-1, keepdim=True)
        scan_at = functools.partial(
            mecheval_kernels.at_positions,
            mecheval_kernels.chunk_delta_rule,
            q,
            k,
            v,
            self._beta(hidden_states),
            initial_state=state,
            use_qk_l2norm_in_kernel=self.qk_norm == "l2",
        )
        return scan_at, windows, None

    def output(self, out: torch.Tensor, aside: None, at: torch.Tensor | None) -> torch.Tensor:
        # In float32: the kernel returns q's dtype (bf16 under autocast), the norm's weight is
        # float32, and a mixed-dtype RMSNorm falls off its fused path with a warning.
        o = self.o_norm(out.float())  # (B, T or 1, H, V)
        return self.o_proj(o.flatten(-2))
