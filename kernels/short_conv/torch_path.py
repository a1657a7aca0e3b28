"""The PyTorch path of the short convolution (the CPU fast path), with its own backward.

The pre-activation is W shifted multiply-adds into one buffer in x's layout (fewer passes and
allocations than a grouped `F.conv1d`, whose layout reorders dominate on long inputs); the
forward keeps it for the SiLU derivative. The backward uses PyTorch's fused SiLU derivative, W
shifted multiply-adds for the input gradient and, for the weight gradient, the reduction that
wins at the size and layout (see `CORRELATION_MAX_ELEMENTS`). All in float32 (float64 stays
float64), like the Triton path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mecheval_kernels._op import compute_dtype
from mecheval_kernels.layout import match_layout
from mecheval_kernels.short_conv.op import ConvArgs

# The weight gradient: one grouped correlation (input windows x output gradient) for small
# inputs, W batched dot products (torch.bmm) beyond, where the correlation's many long groups
# run slowly (measured on CPU; benchmarks/bench_short_conv.py times the op).
CORRELATION_MAX_LENGTH = 64
CORRELATION_MAX_ELEMENTS = 1 << 18


def _pre_activation(xc: torch.Tensor, a: ConvArgs) -> torch.Tensor:
    """bias + sum_k weight[:, k] x[t - (W - 1 - k)], (B, D, L) in xc's dtype, the taps added
    in the order of k; positions before 0 read the initial states (or nothing)."""
    B, D, L = xc.shape
    W = a.weight.shape[1]
    w = a.weight.to(xc.dtype)
    bias = None if a.bias is None else a.bias.to(xc.dtype)[:, None]
    init = None if a.initial_states is None else a.initial_states.to(xc.dtype)
    y = torch.empty_like(xc)  # x's layout: every multiply-add then reads and writes in order
    # The first tap writes every position: bias + w[:, 0] x[t - (W - 1)], or the bias alone
    # (plus the initial states' term) where t - (W - 1) < 0.
    head = min(W - 1, L)
    if head < L:
        x0, w0 = xc[..., : L - head], w[:, 0, None]
        if bias is None:
            torch.mul(x0, w0, out=y[..., head:])
        else:
            torch.addcmul(bias.expand(B, D, L - head), x0, w0, out=y[..., head:])
    if head > 0:
        y[..., :head] = 0 if bias is None else bias
    for k in range(W):
        shift = W - 1 - k  # y[t] reads x[t - shift]
        if k > 0 and shift < L:
            y[..., shift:].addcmul_(xc[..., : L - shift], w[:, k, None])
        if init is not None and shift > 0:  # y[t] for t < shift reads initial_states[t + k]
            reach = min(shift, L)
            y[..., :reach].addcmul_(init[..., k : k + reach], w[:, k, None])
    return y


def forward(a: ConvArgs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """y (B, D, L) in x's dtype and layout, and the pre-activation the backward reuses (None
    without SiLU, whose backward needs none, or when no backward will run)."""
    pre = _pre_activation(a.x.to(compute_dtype(a.x)), a)
    keep = a.silu and a.save
    y = F.silu(pre, inplace=not keep) if a.silu else pre
    return match_layout(y, a.x, a.x.dtype), pre if keep else None


def _padded(x: torch.Tensor, initial_states: torch.Tensor | None, width: int) -> torch.Tensor:
    """(B, D, W - 1 + L): the inputs before x (initial states or zeros), then x."""
    B, D, L = x.shape
    padded = x.new_empty(B, D, width - 1 + L, dtype=compute_dtype(x))
    if initial_states is None:
        padded[..., : width - 1] = 0
    else:
        padded[..., : width - 1] = initial_states
    padded[..., width - 1 :] = x
    return padded


def backward(a: ConvArgs, grads: tuple, saved: tuple) -> list[torch.Tensor | None]:
    """Gradients (dx, dweight, dbias, dinitial_states); None for absent inputs."""
    (dy,), (pre,) = grads, saved
    B, D, L = a.x.shape
    W = a.weight.shape[1]
    g = dy.to(compute_dtype(a.x))
    if a.silu:
        if pre.numel() == 0:  # not kept by the forward
            pre = _pre_activation(a.x.to(g.dtype), a)
        g = torch.ops.aten.silu_backward(g, pre)
    w = a.weight.to(g.dtype)
    # x[s] collects g[s + W-1-k] w[k] and initial_states[j] collects g[j - k] w[k] (k <= j),
    # summed in the order of k.
    dx = torch.empty_like(g)
    head = min(W - 1, L)  # the first tap: dx[s] = g[s + W - 1] w[0], 0 past the end
    torch.mul(g[..., head:], w[:, 0, None], out=dx[..., : L - head])
    dx[..., L - head :] = 0
    for k in range(1, W):
        shift = W - 1 - k
        if shift < L:
            dx[..., : L - shift].addcmul_(g[..., shift:], w[:, k, None])
    dinit = None
    if a.initial_states is not None:
        dinit = g.new_zeros(B, D, W - 1)
        for k in range(W - 1):
            reach = min(W - 1 - k, L)
            dinit[..., k : k + reach].addcmul_(g[..., :reach], w[:, k, None])
    dbias = None if a.bias is None else g.sum((0, 2))
    # dweight[d, k] = sum_{b, t} g[b, d, t] x[b, d, t - (W - 1 - k)], initial states before 0.
    if L < CORRELATION_MAX_LENGTH or g.numel() < CORRELATION_MAX_ELEMENTS:
        padded = _padded(a.x, a.initial_states, W)  # a correlation per (b, d)
        windows = F.conv1d(padded.reshape(1, B * D, -1), g.reshape(B * D, 1, L), groups=B * D)
        return [dx, windows.reshape(B, D, W).sum(0), dbias, dinit]
    xc = a.x.to(g.dtype)
    dweight = w.new_empty(W, B, D)
    time_last = g.stride(-1) == 1 and xc.stride(-1) == 1
    for k in range(W):
        shift = W - 1 - k  # W - 1 < CORRELATION_MAX_LENGTH <= L
        if time_last:
            rows, cols = (
                g[..., shift:].reshape(B * D, 1, -1),
                xc[..., : L - shift].reshape(B * D, -1, 1),
            )
            torch.bmm(rows, cols, out=dweight[k].view(B * D, 1, 1))
        else:  # channels innermost (a (B, L, D) tensor): the reshapes would copy
            torch.sum(g[..., shift:] * xc[..., : L - shift], -1, out=dweight[k])
        if a.initial_states is not None and shift > 0:
            dweight[k] += (g[..., :shift] * a.initial_states[..., k:].to(g.dtype)).sum(-1)
    return [dx, dweight.sum(1).T, dbias, dinit]
