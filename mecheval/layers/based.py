"""Based linear attention (Arora et al. 2024): causal linear attention with a 2nd-order Taylor
feature map.

With phi(x) = [1, x / d^(1/4), vec(x x^T) / (sqrt(2) sqrt(d))] (d = feature_dim), for which
phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(d), each head computes

    y_t = sum_{s <= t} (phi(q_t) . phi(k_s)) v_s / (sum_{s <= t} phi(q_t) . phi(k_s) + eps).

Training runs the equivalent quadratic form (zoology's "quadratic" train view): the (L, L)
matrix 1 + s + s^2 / 2, masked causally; at the study's lengths it is the cheapest form.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from mecheval.layers.mixer import Mixer
from mecheval.layers.resume import Resume, leave_context, resumed_from


class BasedLinearAttention(Mixer):
    """Based linear attention, zoology's `Based` (parameter names proj_q/proj_k/proj_v/proj_o).

    Args:
        d_model: channels in and out.
        feature_dim: size of the projected q and k per head, before the feature map.
        num_heads: heads (values split into head_dim = d_model // num_heads).
        eps: added to the normaliser.
    """

    def __init__(
        self, d_model: int, feature_dim: int = 8, num_heads: int = 1, eps: float = 1e-12
    ) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model {d_model} must be divisible by num_heads {num_heads}")
        self.d_model, self.feature_dim, self.num_heads, self.eps = (
            d_model,
            feature_dim,
            num_heads,
            eps,
        )
        self.head_dim = d_model // num_heads
        self.proj_q = nn.Linear(d_model, feature_dim * num_heads, bias=False)
        self.proj_k = nn.Linear(d_model, feature_dim * num_heads, bias=False)
        self.proj_v = nn.Linear(d_model, d_model, bias=False)
        self.proj_o = nn.Linear(d_model, d_model, bias=False)

    # Context: the keys and values so far, (B, H, P, F) and (B, H, P, head_dim): resumed
    # queries run the same quadratic form over them.
    resumable = True

    def forward(self, x: torch.Tensor, resume: Resume | None = None) -> torch.Tensor:
        """x: (B, L, d_model) -> (B, L, d_model)."""
        B, L, _ = x.shape
        H, F = self.num_heads, self.feature_dim
        q = self.proj_q(x).view(B, L, H, F).transpose(1, 2)
        k = self.proj_k(x).view(B, L, H, F).transpose(1, 2)
        v = self.proj_v(x).view(B, L, H, self.head_dim).transpose(1, 2)
        k_before, v_before = resumed_from(resume, 2)
        if k_before is not None:
            k, v = torch.cat([k_before, k], dim=2), torch.cat([v_before, v], dim=2)
        leave_context(resume, k, v)
        P = k.shape[2] - L  # the positions before these queries
        s = q @ k.transpose(-1, -2) / math.sqrt(F)  # (B, H, L, P + L)
        a = 1 + s + 0.5 * s * s
        causal = torch.ones(L, P + L, dtype=torch.bool, device=x.device).tril(P)
        a = a.masked_fill(~causal, 0.0)
        y = (a @ v) / (a.sum(-1, keepdim=True) + self.eps)
        return self.proj_o(y.transpose(1, 2).reshape(B, L, self.d_model))

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens, as zoology counts them: the KV state and the
        normaliser over the symmetric feature expansion of size 1 + F + F (F + 1) / 2."""
        expanded = 1 + self.feature_dim + self.feature_dim * (self.feature_dim + 1) // 2
        return self.num_heads * (self.head_dim + 1) * expanded
