"""Retention (Sun et al. 2023, RetNet's multi-scale retention, without xPos), a mixer that is not
in mecheval's zoo, written as docs/mixers.md walks through it. Per head h, with a fixed decay
gamma_h = 1 - 2^(-5 - h):

    S_t = gamma_h S_{t-1} + k_t^T v_t ;  o_t = q_t S_t / sqrt(d_head)
    out = W_o (silu(W_g x) * rmsnorm_per_head(o))

    Retention            forward alone: correct; the grid reruns whole documents
    ResumableRetention   + resuming from the state S: the grid restarts at each patch
    DeclaredRetention    + the declarations the grid uses to skip and shorten work

Train and evaluate one from the command line, by import path:

    mecheval train arch=examples.retention:ResumableRetention task.options.num_pairs=4 ...
    mecheval evaluate runs/<that run>
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mecheval.layers import Mixer, Site
from mecheval.layers.resume import Resume, pick


class Retention(Mixer):
    """Multi-scale retention. Sites: `q`, `k`, `v` (B, L, d_model), the projections.

    Args:
        d_model: channels in and out; num_heads must divide it.
        num_heads: heads, each with its own decay.
    """

    def __init__(self, d_model: int, num_heads: int = 2) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model {d_model} must be divisible by num_heads {num_heads}")
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.q_proj, self.k_proj, self.v_proj, self.g_proj, self.o_proj = (
            nn.Linear(d_model, d_model, bias=False) for _ in range(5)
        )
        self.register_buffer("gamma", 1 - 2.0 ** (-5 - torch.arange(num_heads).float()))
        self.q, self.k, self.v = Site("q"), Site("k"), Site("v")

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, d_model) -> (B, H, L, d_head)."""
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q = self.heads(self.q(self.q_proj(x))) * self.head_dim**-0.5
        return q, self.heads(self.k(self.k_proj(x))), self.heads(self.v(self.v_proj(x)))

    def decay(self, length: int) -> torch.Tensor:
        """(H, L, L): gamma^(n - m) for m <= n, else 0."""
        n = torch.arange(length, device=self.gamma.device, dtype=self.gamma.dtype)
        lag = n[:, None] - n[None, :]
        return (self.gamma[:, None, None] ** lag.clamp(min=0)) * (lag >= 0)

    def output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o (B, H, L, d_head) -> (B, L, d_model): norm per head, swish gate, projection."""
        o = F.rms_norm(o, (self.head_dim,)).transpose(1, 2).flatten(2)
        return self.o_proj(F.silu(self.g_proj(x)) * o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, d_model) -> (B, L, d_model)."""
        q, k, v = self.qkv(x)
        o = ((q @ k.transpose(-1, -2)) * self.decay(x.shape[1])) @ v
        return self.output(o, x)


class ResumableRetention(Retention):
    """Retention that continues a sequence from its context, the state S (B, H, d_head,
    d_head) after the positions before."""

    resumable = True

    def forward(self, x: torch.Tensor, resume: Resume | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x)
        length = x.shape[1]
        o = ((q @ k.transpose(-1, -2)) * self.decay(length)) @ v
        before = None if resume is None or resume.context is None else resume.context[0]
        powers = self.gamma[:, None] ** torch.arange(1, length + 1, device=x.device)  # (H, L)
        if before is not None:  # what the earlier positions wrote, decayed to each position
            o = o + (q @ before) * powers[..., None]
        if resume is not None:
            resume.context = (self.state_after(k, v, before, powers),)
        return self.output(o, x)

    def state_after(self, k, v, before, powers) -> torch.Tensor:
        """S after the last of L positions: gamma^L S_before + sum_j gamma^(L-1-j) k_j^T v_j."""
        weights = powers.flip(-1) / self.gamma[:, None]  # gamma^(L-1-j)
        state = (k * weights[..., None]).transpose(-1, -2) @ v
        return state if before is None else state + before * powers[:, -1, None, None]


class DeclaredRetention(ResumableRetention):
    """Retention with the declarations the grid uses (mecheval.layers.mixer): its projections
    are token-local, q reads the state out at its own position alone, the contexts come from
    one run's k and v, and the output can be formed at one position per row."""

    reads_out_at = True
    local_sites = ("q", "k", "v")
    readout_sites = {"q": 1}
    context_sites = ("k", "v")

    def context_from(self, values: dict, point: int, index: int) -> tuple:
        k, v = (self.heads(values[name][:, :point]) for name in ("k", "v"))
        powers = self.gamma[:, None] ** torch.arange(1, point + 1, device=k.device)
        return (self.state_after(k, v, None, powers),)

    def forward(self, x, resume: Resume | None = None, at: torch.Tensor | None = None):
        if at is None:
            return super().forward(x, resume)
        q, k, v = self.qkv(x)  # the output at `at` (B,) alone: O(L) per row, not O(L^2)
        rows, length = torch.arange(x.shape[0], device=x.device), x.shape[1]
        q = q[rows, :, at][:, :, None]  # (B, H, 1, d_head)
        lag = (at[:, None] - torch.arange(length, device=x.device))[:, None]  # (B, 1, L)
        decay = self.gamma[:, None] ** lag.clamp(min=0) * (lag >= 0)  # (B, H, L)
        o = ((q @ k.transpose(-1, -2)) * decay[:, :, None]) @ v
        before = None if resume is None or resume.context is None else resume.context[0]
        powers = self.gamma[:, None] ** torch.arange(1, length + 1, device=x.device)
        if before is not None:
            o = o + (q @ before) * powers[:, at].T[..., None, None]
        if resume is not None:
            resume.context = (self.state_after(k, v, before, powers),)
        return self.output(o, pick(x, at))
