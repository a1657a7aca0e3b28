"""Llama (transformers' `LlamaForCausalLM`): pre-RMSNorm blocks of attention with rotary
position embeddings and grouped key/value heads, and a gated MLP; a final RMSNorm; an output
head of its own unless tie_word_embeddings.

    ours                                  transformers'
    embedding                             model.embed_tokens
    layers.i.norm1, norm2                 model.layers.i.input_layernorm, post_attention_layernorm
    layers.i.mixer.{q,k,v,o}_proj         model.layers.i.self_attn.{q,k,v,o}_proj
    layers.i.mlp.{gate,up,down}_proj      model.layers.i.mlp.{gate,up,down}_proj
    norm_f, lm_head                       model.norm, lm_head

The rotary embeddings' inverse frequencies and cos/sin scaling are the checkpoint's own (read
from the model object's rotary module, whatever its static rope_type: default, linear, llama3,
yarn); the types that change with the sequence length (dynamic, longrope) are refused.
"""

from __future__ import annotations

from torch import nn

from mecheval.layers.grouped_attention import GroupedQueryAttention, Rotary
from mecheval.layers.mlp import ACTIVATIONS, GatedMLP
from mecheval.models.blocks import PreNormBlock
from mecheval.models.pretrained.convert import (
    Weights,
    assemble,
    head_module,
    head_of,
    on_meta,
    require,
    tied,
)
from mecheval.models.pretrained.model import PretrainedConfig, PretrainedModel

STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def rope_type(config) -> str:
    """The config's rotary type (transformers 5's rope_parameters, 4's rope_scaling)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return (parameters or {}).get("rope_type", "default")


def check(config, source: str) -> None:
    """Refuse the options of a Llama config mecheval does not build."""
    act = config.hidden_act
    require(act in ACTIVATIONS, source, f"hidden_act {act!r} is not supported")
    kind = rope_type(config)
    require(kind in STATIC_ROPE, source, f"rope_type {kind!r} is not supported ({STATIC_ROPE})")
    require(getattr(config, "pretraining_tp", 1) in (None, 1), source, "pretraining_tp > 1")


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _block(config, rotary: Rotary) -> PreNormBlock:
    d, eps, bias = config.hidden_size, config.rms_norm_eps, config.attention_bias
    mixer = GroupedQueryAttention(
        d,
        config.num_attention_heads,
        config.num_key_value_heads,
        _head_dim(config),
        qkv_bias=bias,
        out_bias=bias,
        rotary=rotary,
    )
    mlp = GatedMLP(d, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)
    return PreNormBlock(mixer, nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps), mlp)


def _state(weights: Weights, parts: dict, hf_model) -> dict:
    """Our names -> the checkpoint's tensors (every part's names match transformers')."""
    state = {
        "embedding.weight": weights.take("model.embed_tokens.weight"),
        "norm_f.weight": weights.take("model.norm.weight"),
        **head_of(weights, hf_model),
    }
    for i, block in enumerate(parts["layers"]):
        theirs, ours = f"model.layers.{i}.", f"layers.{i}."
        state.update(weights.like(block.mixer, f"{theirs}self_attn.", f"{ours}mixer."))
        state.update(weights.like(block.mlp, f"{theirs}mlp.", f"{ours}mlp."))
        state.update(weights.like(block.norm1, f"{theirs}input_layernorm.", f"{ours}norm1."))
        state.update(
            weights.like(block.norm2, f"{theirs}post_attention_layernorm.", f"{ours}norm2.")
        )
    return state


def convert(hf_model, source: str, max_len: int | None = None) -> PretrainedModel:
    """Our model of a transformers LlamaForCausalLM (its tensors shared)."""
    config = hf_model.config
    check(config, source)
    d, vocab = config.hidden_size, config.vocab_size
    limit = config.max_position_embeddings
    ours = PretrainedConfig(
        "llama", source, vocab, d, config.num_hidden_layers, max_len or limit, tied(hf_model)
    )
    emb = hf_model.model.rotary_emb
    rotary = Rotary(emb.inv_freq.detach().float().cpu(), emb.attention_scaling)
    parts = on_meta(
        lambda: {
            "embedding": nn.Embedding(vocab, d),
            "layers": [_block(config, rotary) for _ in range(config.num_hidden_layers)],
            "norm_f": nn.RMSNorm(d, eps=config.rms_norm_eps),
            "lm_head": head_module(hf_model, vocab, d),
        }
    )
    weights = Weights(hf_model.state_dict(), source)
    state = _state(weights, parts, hf_model)
    weights.check_all_used()
    model = assemble(ours, parts, state)
    return model.to(hf_model.model.embed_tokens.weight.device)
