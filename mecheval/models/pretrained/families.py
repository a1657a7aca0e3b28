"""The families `from_pretrained` reads, by the model_type of a checkpoint's config, each with
its `check` (refuse, by name, an option mecheval does not build, before any weight is read) and
its `convert` (our model of a Hugging Face model object)."""

from __future__ import annotations

from types import ModuleType

from torch import nn

from mecheval.models.pretrained import fla, gpt2, llama, mamba
from mecheval.models.pretrained.model import FAMILIES, PretrainedModel

_MODULES: dict[str, ModuleType] = {
    "gpt2": gpt2,
    "llama": llama,
    "mamba": mamba,
    "mamba2": mamba,
    "delta_net": fla,
    "gated_deltanet": fla,
}


def family_of(config, source: str) -> ModuleType:
    """The module of the family of a Hugging Face config (its model_type); ValueError naming
    the families known otherwise."""
    model_type = getattr(config, "model_type", None)
    if model_type not in _MODULES:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; from_pretrained reads "
            f"{', '.join(FAMILIES)}"
        )
    return _MODULES[model_type]


def check(config, source: str) -> None:
    """Refuse a config mecheval cannot build (its family, or an option of it), by name."""
    family_of(config, source).check(config, source)


def convert(hf_model: nn.Module, source: str | None = None, max_len: int | None = None):
    """Our model of a Hugging Face causal LM object (transformers' GPT2LMHeadModel,
    LlamaForCausalLM, MambaForCausalLM, Mamba2ForCausalLM, fla's DeltaNetForCausalLM,
    GatedDeltaNetForCausalLM), sharing its tensors where their layout is ours.

    Args:
        hf_model: the model object.
        source: what it was loaded from, for messages and the config (default: its class).
        max_len: longest sequence to accept (default: the checkpoint's own limit).
    """
    if not isinstance(hf_model, nn.Module) or not hasattr(hf_model, "config"):
        raise TypeError(
            f"expected a Hugging Face model object (with a .config), got {type(hf_model).__name__}"
        )
    source = source or type(hf_model).__name__
    model: PretrainedModel = family_of(hf_model.config, source).convert(hf_model, source, max_len)
    return model
