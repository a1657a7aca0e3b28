"""Mamba and Mamba-2 (transformers' `MambaForCausalLM`, `Mamba2ForCausalLM`): pre-RMSNorm
blocks of mecheval's Mamba or Mamba2 layer (no MLP), a final RMSNorm, the head tied to the
embedding unless the config unties it.

    ours                                  transformers'
    embedding                             backbone.embeddings
    layers.i.norm                         backbone.layers.i.norm
    layers.i.mixer.*                      backbone.layers.i.mixer.* (mamba-ssm's names)
    norm_f, lm_head                       backbone.norm_f, lm_head

mecheval's layers take mamba-ssm's parameter names, which transformers' mixers keep, and run
their scans through mecheval_kernels: the grid reads and patches the SSM state inside them.
transformers keeps the residual stream in float32 (residual_in_fp32) in a half-precision model;
ours stays in the model's dtype (the same in float32).
"""

from __future__ import annotations

from torch import nn

from mecheval.layers.mamba import Mamba
from mecheval.layers.mamba2 import Mamba2
from mecheval.models.blocks import MambaBlock
from mecheval.models.pretrained.convert import (
    Weights,
    assemble,
    head_module,
    head_of,
    on_meta,
    require,
    tied,
)
from mecheval.models.pretrained.model import UNBOUNDED, PretrainedConfig, PretrainedModel


def check(config, source: str) -> None:
    """Refuse the options of a Mamba or Mamba-2 config mecheval does not build."""
    act = config.hidden_act
    require(act == "silu", source, f"hidden_act {act!r} is not supported (Mamba's is silu)")
    require(1 <= config.conv_kernel <= 8, source, f"conv_kernel {config.conv_kernel} not in 1..8")
    if config.model_type == "mamba2":
        inner = config.expand * config.hidden_size
        require(
            config.num_heads * config.head_dim == inner,
            source,
            f"num_heads * head_dim must equal expand * hidden_size ({inner})",
        )


def _mixer(config, layer: int) -> Mamba | Mamba2:
    d = config.hidden_size
    common = {
        "d_state": config.state_size,
        "d_conv": config.conv_kernel,
        "conv_bias": config.use_conv_bias,
        "bias": config.use_bias,
        "layer_idx": layer,
    }
    if config.model_type == "mamba":
        mixer = Mamba(
            d, expand=config.intermediate_size / d, dt_rank=config.time_step_rank, **common
        )
        if mixer.d_inner != config.intermediate_size:
            raise ValueError(f"intermediate_size {config.intermediate_size} is no multiple of {d}")
        return mixer
    mixer = Mamba2(
        d,
        expand=config.expand,
        headdim=config.head_dim,
        ngroups=config.n_groups,
        dt_limit=tuple(config.time_step_limit),
        **common,
    )
    mixer.norm.eps = config.layer_norm_epsilon  # transformers' gated norm takes the config's
    return mixer


def convert(hf_model, source: str, max_len: int | None = None) -> PretrainedModel:
    """Our model of a transformers MambaForCausalLM or Mamba2ForCausalLM (its tensors shared)."""
    config = hf_model.config
    check(config, source)
    d, vocab, n = config.hidden_size, config.vocab_size, config.num_hidden_layers
    eps = config.layer_norm_epsilon
    ours = PretrainedConfig(
        config.model_type, source, vocab, d, n, max_len or UNBOUNDED, tied(hf_model)
    )
    parts = on_meta(
        lambda: {
            "embedding": nn.Embedding(vocab, d),
            "layers": [MambaBlock(d, _mixer(config, i), norm_eps=eps) for i in range(n)],
            "norm_f": nn.RMSNorm(d, eps=eps),
            "lm_head": head_module(hf_model, vocab, d),
        }
    )
    weights = Weights(hf_model.state_dict(), source)
    state = {
        "embedding.weight": weights.take("backbone.embeddings.weight"),
        "norm_f.weight": weights.take("backbone.norm_f.weight"),
        **head_of(weights, hf_model),
    }
    for i, block in enumerate(parts["layers"]):
        state.update(weights.like(block, f"backbone.layers.{i}.", f"layers.{i}."))
    weights.check_all_used()
    return assemble(ours, parts, state)
