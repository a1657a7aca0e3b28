"""Causal softmax attention with grouped key/value heads and optional rotary position embeddings:
the attention of pretrained Transformers (GPT-2's: biases, no rotary, one key/value head per
query head; Llama's: rotary, grouped key/value heads).

    q, k, v = x W_q + b_q, x W_k + b_k, x W_v + b_v      H heads of q, H_kv of k and v, head_dim D
    q, k = rotate(q, t), rotate(k, t)                    rotary, at each token's position t
    y_h = softmax(scale q_h k_g^T + causal mask) v_g     g = h // (H / H_kv)
    out = [y_1 ... y_H] W_o + b_o

Rotary embeddings pair channel i with channel i + D/2 of each head (Hugging Face's Llama
layout: its checkpoints' q and k projections are laid out for it), with inverse frequencies
and a scaling of cos and sin given by the checkpoint's configuration (`Rotary`).

The mixer resumes: its context is the keys (rotated) and values of the positions before (the
grid then restarts a patched run at its patch); it reads out at one position per row (only that
query is formed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mecheval.layers.mixer import Mixer
from mecheval.layers.resume import Resume, leave_context, pick, resumed_from


class Rotary(nn.Module):
    """Rotary position embeddings (Su et al. 2021) in the half-split layout.

    Args:
        inv_freq: (D / 2,) the inverse frequency of each channel pair (float32).
        scaling: cos and sin are multiplied by it (YaRN's attention factor; 1 otherwise).
    """

    def __init__(self, inv_freq: torch.Tensor, scaling: float = 1.0) -> None:
        super().__init__()
        if inv_freq.dim() != 1:
            raise ValueError(f"inv_freq must be 1-D (head_dim / 2,), got {tuple(inv_freq.shape)}")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, heads, T, D) at positions (T,) or (B, T) -> x rotated, in x's dtype. cos and
        sin are formed in float32, then cast to x's dtype (as Hugging Face's Llama does)."""
        freqs = positions.to(x.device).float()[..., None] * self.inv_freq.float()
        angles = torch.cat([freqs, freqs], dim=-1)
        if angles.dim() == 3:  # (B, T, D): one set of positions per row
            angles = angles[:, None]
        cos = (angles.cos() * self.scaling).to(x.dtype)
        sin = (angles.sin() * self.scaling).to(x.dtype)
        half = x.shape[-1] // 2
        turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + turned * sin


class GroupedQueryAttention(Mixer):
    """Causal attention with `num_kv_heads` key/value heads shared by groups of query heads.

    Parameters `q_proj`, `k_proj`, `v_proj`, `o_proj` (Hugging Face's Llama names).

    Args:
        d_model: channels in and out.
        num_heads: query heads H.
        num_kv_heads: key/value heads (None: H); H must be a multiple of it.
        head_dim: channels per head (None: d_model / H).
        qkv_bias: whether q, k and v projections have biases.
        out_bias: whether the output projection has a bias.
        rotary: rotary embeddings of q and k (None: no position information here).
        scale: the scores' factor (None: head_dim ** -0.5).
    """

    resumable = True  # context: (keys, values) of the positions so far, keys rotated
    reads_out_at = True

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        out_bias: bool = False,
        rotary: Rotary | None = None,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model {d_model} must be divisible by num_heads {num_heads}")
            head_dim = d_model // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}"
            )
        if rotary is not None and rotary.head_dim != head_dim:
            raise ValueError(f"rotary covers {rotary.head_dim} channels, heads have {head_dim}")
        self.d_model, self.num_heads, self.num_kv_heads = d_model, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, d_model, bias=out_bias)
        self.rotary = rotary

    def forward(
        self, x: torch.Tensor, resume: Resume | None = None, at: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: (B, L, d_model) -> (B, L, d_model), or (B, 1, d_model) at positions `at` (B,)
        alone; `resume`: the keys and values of the positions before x's (see the module
        docstring)."""
        batch, length, _ = x.shape
        k_before, v_before = resumed_from(resume, 2)
        start = 0 if k_before is None else k_before.shape[2]
        q = self._heads(self.q_proj(pick(x, at)), self.num_heads)  # (B, H, L or 1, D)
        k = self._heads(self.k_proj(x), self.num_kv_heads)
        v = self._heads(self.v_proj(x), self.num_kv_heads)
        positions = torch.arange(start, start + length, device=x.device)
        q_positions = positions if at is None else start + at.to(x.device)[:, None]
        if self.rotary is not None:
            q, k = self.rotary(q, q_positions), self.rotary(k, positions)
        if k_before is not None:
            k, v = torch.cat([k_before, k], dim=2), torch.cat([v_before, v], dim=2)
        if resume is not None and resume.leave:
            leave_context(resume, k, v)
        y = self._attend(q, k, v, None if at is None and start == 0 else q_positions)
        return self.o_proj(y.transpose(1, 2).flatten(2))

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, T, heads * D) -> (B, heads, T, D)."""
        return x.unflatten(-1, (heads, self.head_dim)).transpose(1, 2)

    def _attend(self, q, k, v, q_positions: torch.Tensor | None) -> torch.Tensor:
        """Softmax attention of q (B, H, T, D) over k, v (B, H_kv, S, D); each query sees the
        keys at or before its position (q_positions (T,) or (B, 1); None: T = S, causal)."""
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if q_positions is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        keys = torch.arange(k.shape[2], device=q.device)
        mask = keys <= q_positions[..., None]  # (T, S) or (B, 1, S)
        if mask.dim() == 3:
            mask = mask[:, None]  # (B, 1, 1, S): one query per row
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    def state_size(self, sequence_length: int) -> int:
        """Floats carried between tokens: the key and value cache."""
        return 2 * self.num_kv_heads * self.head_dim * sequence_length
