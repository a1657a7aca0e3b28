"""What every family's conversion shares: the checkpoint's tensors handed out by name
(`Weights`), each used once and none left over, and the model assembled from parts built on the
meta device and given those tensors (`assemble`).

The model shares the checkpoint's tensors where a weight keeps its layout (no copy); a weight
stored transposed (GPT-2's Conv1D) or fused (GPT-2's c_attn) is copied once, rearranged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from mecheval.models.pretrained.model import PretrainedConfig, PretrainedModel


class Weights:
    """A checkpoint's state dict, taken from by name: a name missing, or one left over at the
    end (a part of the checkpoint the conversion would drop), is refused naming it.

    Args:
        state: Hugging Face parameter name -> tensor (the model object's `state_dict()`).
        source: the checkpoint, for the messages.
    """

    def __init__(self, state: Mapping[str, torch.Tensor], source: str) -> None:
        self.state, self.source = dict(state), source
        self.used: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"{self.source}: the checkpoint has no weight {name!r}")
        self.used.add(name)
        return self.state[name]

    def drop(self, name: str) -> None:
        """Mark `name` used without taking it (a tied head's copy of the embedding)."""
        self.take(name)

    def like(self, module: nn.Module, theirs: str, ours: str) -> dict[str, torch.Tensor]:
        """Every tensor of `module`'s state dict, from the checkpoint's names of the same
        suffix under `theirs`, keyed by ours under `ours`: for parts whose names match the
        checkpoint's (mecheval's Mamba, DeltaNet and norms take their peers' names)."""
        return {f"{ours}{name}": self.take(f"{theirs}{name}") for name in module.state_dict()}

    def check_all_used(self) -> None:
        left = sorted(set(self.state) - self.used)
        if left:
            shown = ", ".join(left[:4]) + (f" and {len(left) - 4} more" if len(left) > 4 else "")
            raise ValueError(
                f"{self.source}: the conversion would leave out weights of the checkpoint "
                f"({shown}): it uses an option mecheval does not build"
            )


def on_meta(parts: Callable[[], dict]) -> dict:
    """`parts()` (PretrainedModel's keyword arguments) built on the meta device: no memory, no
    random numbers drawn."""
    with torch.device("meta"):
        return parts()


def assemble(config: PretrainedConfig, parts: dict, state: Mapping[str, torch.Tensor]):
    """The PretrainedModel of `parts` (built `on_meta`), given the tensors `state` names by our
    parameter names (every one, none more)."""
    model = PretrainedModel(config, **parts)
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.missing_keys or result.unexpected_keys:  # a conversion's bug, named
        raise RuntimeError(
            f"conversion of {config.family}: missing {result.missing_keys[:4]}, "
            f"unexpected {result.unexpected_keys[:4]}"
        )
    left = [name for name, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise RuntimeError(f"conversion of {config.family}: {left[:4]} left on the meta device")
    return model.eval()


def tied(hf_model: nn.Module) -> bool:
    """Whether a Hugging Face causal LM's output head is its embedding's matrix."""
    head, embedding = hf_model.get_output_embeddings(), hf_model.get_input_embeddings()
    return head.weight is embedding.weight or (
        head.weight.data_ptr() == embedding.weight.data_ptr()
        and head.weight.shape == embedding.weight.shape
    )


def head_of(weights: Weights, hf_model: nn.Module, name: str = "lm_head.weight") -> dict:
    """The output head's tensor by our name ("lm_head.weight"), or none where it is tied (its
    copy then marked used)."""
    if tied(hf_model):
        if name in weights.state:
            weights.drop(name)
        return {}
    return {"lm_head.weight": weights.take(name)}


def head_module(hf_model: nn.Module, vocab_size: int, d_model: int) -> nn.Linear | None:
    """Our output head (built on the current device), or None where it is tied."""
    return None if tied(hf_model) else nn.Linear(d_model, vocab_size, bias=False)


def require(condition: bool, source: str, what: str) -> None:
    """Refuse a checkpoint option mecheval does not build: ValueError '{source}: {what}'."""
    if not condition:
        raise ValueError(f"{source}: {what}")
