"""Causal multi-head softmax self-attention (zoology's `MHA` built with bias=False: the fused
q/k/v projection has no bias, the output projection keeps one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mecheval.layers.resume import Resume


class CausalSelfAttention(nn.Module):
    """Causal softmax attention: one fused q/k/v projection `Wqkv`, output projection `out_proj`.

    Args:
        d_model: channels in and out.
        num_heads: heads; head_dim = d_model // num_heads, scores scaled by head_dim^-1/2.
    """

    def __init__(self, d_model: int, num_heads: int = 1) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model {d_model} must be divisible by num_heads {num_heads}")
        self.d_model, self.num_heads = d_model, num_heads
        self.head_dim = d_model // num_heads
        self.Wqkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model)

    resumable = True  # see mecheval.layers.resume; context: (keys, values) so far

    def forward(self, x: torch.Tensor, resume: Resume | None = None) -> torch.Tensor:
        """x: (B, L, d_model) -> (B, L, d_model)."""
        B, L, _ = x.shape
        qkv = self.Wqkv(x).view(B, L, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, L, head_dim)
        if resume is None or resume.state is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # queries at positions P.. see the P earlier keys and the causal part of these
            k_before, v_before = resume.state
            k, v = torch.cat([k_before, k], dim=2), torch.cat([v_before, v], dim=2)
            P = k.shape[2] - L
            keys = torch.arange(P + L, device=x.device)
            mask = keys[None, :] <= (P + torch.arange(L, device=x.device))[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        if resume is not None:
            resume.state = (k, v)
        return self.out_proj(y.transpose(1, 2).reshape(B, L, self.d_model))

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the key and value cache."""
        return 2 * self.d_model * sequence_length
