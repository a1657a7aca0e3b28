"""Causal multi-head softmax self-attention (zoology's `MHA` built with bias=False: the fused
q/k/v projection has no bias, the output projection keeps one).

The scores run through PyTorch's scaled_dot_product_attention, except on CUDA in half precision
when flash-attn is installed (the `gpu` extra): its kernel then runs the whole-sequence causal
pass. fp32 always takes SDPA (flash-attn has no fp32 kernel).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from mecheval.layers.mixer import Mixer
from mecheval.layers.resume import Resume, leave_context, resumed_from


@functools.cache
def flash_attn_func():
    """flash-attn's `flash_attn_func`, or None when it is not installed."""
    try:
        from flash_attn import flash_attn_func as func
    except ImportError:
        return None
    return func


def uses_flash_attn(q: torch.Tensor) -> bool:
    """Whether the causal pass on q runs flash-attn's kernel (see the module docstring)."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    return q.is_cuda and half and flash_attn_func() is not None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention of (B, H, L, head_dim) q, k, v, scaled by head_dim^-1/2."""
    if uses_flash_attn(q):  # flash-attn takes (B, L, H, head_dim)
        y = flash_attn_func()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return y.transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class CausalSelfAttention(Mixer):
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

    resumable = True  # context: (keys, values) so far

    def forward(self, x: torch.Tensor, resume: Resume | None = None) -> torch.Tensor:
        """x: (B, L, d_model) -> (B, L, d_model)."""
        B, L, _ = x.shape
        qkv = self.Wqkv(x).view(B, L, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, L, head_dim)
        k_before, v_before = resumed_from(resume, 2)
        if k_before is None:
            y = causal_attention(q, k, v)
        else:  # queries at positions P.. see the P earlier keys and the causal part of these
            k, v = torch.cat([k_before, k], dim=2), torch.cat([v_before, v], dim=2)
            P = k.shape[2] - L
            keys = torch.arange(P + L, device=x.device)
            mask = keys[None, :] <= (P + torch.arange(L, device=x.device))[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        leave_context(resume, k, v)
        return self.out_proj(y.transpose(1, 2).reshape(B, L, self.d_model))

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the key and value cache."""
        return 2 * self.d_model * sequence_length
