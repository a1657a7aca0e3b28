"""The study's models (docs/study.md, "Models"), built from a typed config, with named
intervention sites.

model = build_model("mamba", vocab_size=8195, d_model=64, max_len=37)
logits = model(tokens)                                   # (B, L) -> (B, L, V)
model.site_names()                                       # ["layers.0.block_input", ...]
with model.intervene(reads={"layers.1.block_input": pos},
                     patches={"layers.0.conv_output": (pos, values)}) as record:
    logits = model(tokens)
record["layers.1.block_input"]                           # (B, d_model)
"""

from __future__ import annotations

from mecheval.models.blocks import MambaBlock, TransformerBlock, build_block, build_mixer
from mecheval.models.config import ARCHITECTURES, OPTIONS, ModelConfig
from mecheval.models.language_model import InterventionRecord, LanguageModel


def build_model_from_config(config: ModelConfig) -> LanguageModel:
    """The model `config` describes, freshly initialised (seed with torch.manual_seed)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    return LanguageModel(config)


def build_model(
    arch: str,
    vocab_size: int,
    d_model: int,
    n_layers: int = 2,
    *,
    max_len: int,
    **options: object,
) -> LanguageModel:
    """`build_model_from_config(ModelConfig(arch, vocab_size, d_model, n_layers, max_len=...,
    **options))`; an unknown option raises ValueError naming it (options: see ModelConfig)."""
    valid = (*OPTIONS, "init", "l_max")
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown model option(s) {', '.join(unknown)}; options are {', '.join(valid)}"
        )
    config = ModelConfig(arch, vocab_size, d_model, n_layers, max_len=max_len, **options)
    return build_model_from_config(config)


__all__ = [
    "ARCHITECTURES",
    "OPTIONS",
    "InterventionRecord",
    "LanguageModel",
    "MambaBlock",
    "ModelConfig",
    "TransformerBlock",
    "build_block",
    "build_mixer",
    "build_model",
    "build_model_from_config",
]
