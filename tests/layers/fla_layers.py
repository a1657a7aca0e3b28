"""What the tests of the layers that follow flash-linear-attention's share: fla's layer built on
CPU (its constructor runs there, its forward does not: fla's short convs and norms are Triton)
with its parameters redrawn, fla's naive references run in float64, and the plain-PyTorch pieces
of a float64 transcription of fla's layer forward (its short conv, l2norm and gated RMSNorm)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F


def fla_layer(name: str, seed: int = 0, **options) -> torch.nn.Module:
    """fla.layers.<name>(**options) on CPU, every parameter redrawn from a seeded normal (fla's
    init leaves norms at one and biases at zero, which would hide a swapped parameter)."""
    layers = pytest.importorskip("fla.layers")
    torch.manual_seed(seed)
    with torch.no_grad():
        layer = getattr(layers, name)(**options)
        gen = torch.Generator().manual_seed(seed)
        for parameter in layer.parameters():
            parameter.copy_(0.3 * torch.randn(parameter.shape, generator=gen))
    return layer


def shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in module.state_dict().items()}


class _Float64Torch:
    float = torch.float64
    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def float64(module):
    """fla's naive reference in `module` computing in float64: its casts to float32
    (torch.float, torch.float32, Tensor.float) made casts to float64 while the block runs."""
    real, real_float = module.torch, torch.Tensor.float
    module.torch, torch.Tensor.float = _Float64Torch(), torch.Tensor.double
    try:
        yield
    finally:
        module.torch, torch.Tensor.float = real, real_float


def short_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fla's ShortConvolution (SiLU, no bias): causal depthwise conv over (B, L, C)."""
    W = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight, groups=x.shape[-1])
    return F.silu(y).transpose(1, 2)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """fla's l2norm: x / sqrt(sum(x^2) + 1e-6) over the last dimension."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + 1e-6)


def gated_rmsnorm(x, gate, weight, activation: str, eps: float = 1e-5) -> torch.Tensor:
    """fla's FusedRMSNormGated: x / rms(x) * weight * act(gate) (act: silu or sigmoid)."""
    x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight
    return x * (F.silu(gate) if activation == "swish" else torch.sigmoid(gate))
