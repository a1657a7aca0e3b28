"""The study's models (docs/study.md, "Models") and any mixer registered beside them, built from a
typed config, with named intervention sites.

model = build_model("mamba", vocab_size=8195, d_model=64, max_len=37)
logits = model(tokens)                                   # (B, L) -> (B, L, V)
model.site_names()                                       # ["layers.0.block_input", ...]
with model.intervene(reads={"layers.1.block_input": pos},
                     patches={"layers.0.conv_output": (pos, values)}) as record:
    logits = model(tokens)
record["layers.1.block_input"]                           # (B, d_model)

register_mixer("retnet", RetNet)                         # then build_model("retnet", ...),
build_model("mypackage.mixers:RetNet", ...)              # or by import path, or a hybrid:
build_model("mamba+attention", ...)                      # layer 0 Mamba, layer 1 attention
from_pretrained("openai-community/gpt2")                 # a pretrained checkpoint's model
"""

from __future__ import annotations

from mecheval.models.blocks import MambaBlock, TransformerBlock, build_block
from mecheval.models.config import ARCHITECTURES, ModelConfig
from mecheval.models.language_model import InterventionRecord, LanguageModel
from mecheval.models.pretrained import PretrainedModel, from_pretrained
from mecheval.models.registry import (
    Architecture,
    ArchitectureError,
    MixerEntry,
    UserCodeError,
    architecture,
    mixer_entry,
    register_mixer,
    registered,
)

# build_model's keywords that describe the model rather than its mixers.
MODEL_OPTIONS = ("position_embeddings", "init", "l_max")


def model_config(
    arch: str, vocab_size: int, d_model: int, n_layers: int = 2, *, max_len: int, **options
) -> ModelConfig:
    """The ModelConfig of `build_model`'s arguments: `options` are the model's
    (position_embeddings, init, l_max) and its mixers' (see the architecture's factories); one
    that applies to neither is refused by name."""
    model = {k: options.pop(k) for k in MODEL_OPTIONS if k in options}
    return ModelConfig(
        arch, vocab_size, d_model, n_layers, max_len=max_len, **model, options=options
    )


def build_model(
    arch: str,
    vocab_size: int,
    d_model: int,
    n_layers: int = 2,
    *,
    max_len: int,
    **options: object,
) -> LanguageModel:
    """`LanguageModel(model_config(...))`: the model of these sizes and options, freshly
    initialised (seed with torch.manual_seed). A ModelConfig builds its model as
    `LanguageModel(config)`."""
    return LanguageModel(
        model_config(arch, vocab_size, d_model, n_layers, max_len=max_len, **options)
    )


__all__ = [
    "ARCHITECTURES",
    "MODEL_OPTIONS",
    "Architecture",
    "ArchitectureError",
    "InterventionRecord",
    "LanguageModel",
    "MambaBlock",
    "MixerEntry",
    "ModelConfig",
    "PretrainedModel",
    "TransformerBlock",
    "UserCodeError",
    "architecture",
    "build_block",
    "build_model",
    "from_pretrained",
    "mixer_entry",
    "model_config",
    "register_mixer",
    "registered",
]
