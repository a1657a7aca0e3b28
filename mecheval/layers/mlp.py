"""Feed-forward blocks: `MLP`, Linear-activation-Linear with biases (zoology's `MLP`, GPT-2's
with its tanh GELU), and `GatedMLP`, down(act(gate(x)) * up(x)) (Llama's and
flash-linear-attention's SwiGLU MLP). Activations are named as Hugging Face's configs name them
(`ACTIVATIONS`)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# Hugging Face's names of the activations its GPT-2, Llama and fla checkpoints use ("gelu_new":
# GPT-2's tanh approximation; "swish": fla's name of SiLU).
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": functools.partial(F.gelu, approximate="tanh"),
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str):
    """The activation named `name` (a key of ACTIVATIONS); ValueError naming the known ones."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; known: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class MLP(nn.Module):
    """fc2(act(fc1(x))), with biases.

    Args:
        d_model: channels in and out.
        hidden_mult: hidden width = hidden_mult * d_model (unless `hidden` is given).
        hidden: the hidden width itself (GPT-2's n_inner).
        act: the activation's name (ACTIVATIONS): "gelu" (exact, zoology's), "gelu_new" (GPT-2's).
    """

    def __init__(
        self, d_model: int, hidden_mult: int = 4, hidden: int | None = None, act: str = "gelu"
    ) -> None:
        super().__init__()
        width = hidden_mult * d_model if hidden is None else hidden
        self.act, self._act = act, activation(act)
        self.fc1 = nn.Linear(d_model, width)
        self.fc2 = nn.Linear(width, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, d_model) -> (B, L, d_model)."""
        return self.fc2(self._act(self.fc1(x)))


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)): Llama's MLP and fla's `GatedMLP`, with
    their parameter names.

    Args:
        d_model: channels in and out.
        hidden: the hidden width (Llama's intermediate_size).
        act: the activation's name (ACTIVATIONS), "silu" for SwiGLU.
        bias: whether the three projections have biases (Llama's mlp_bias).
    """

    def __init__(self, d_model: int, hidden: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        self.act, self._act = act, activation(act)
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias)
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, L, d_model) -> (B, L, d_model)."""
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))
