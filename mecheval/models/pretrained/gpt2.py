"""GPT-2 (transformers' `GPT2LMHeadModel`): learned position embeddings, pre-LayerNorm blocks of
attention (biases, H heads) and a GELU MLP, a final LayerNorm, the head tied to the embedding.

    ours                                  transformers'
    embedding, position_embedding         transformer.wte, transformer.wpe
    layers.i.norm1, norm2                 transformer.h.i.ln_1, ln_2
    layers.i.mixer.{q,k,v}_proj           transformer.h.i.attn.c_attn (split in three, transposed)
    layers.i.mixer.o_proj                 transformer.h.i.attn.c_proj (transposed)
    layers.i.mlp.fc1, fc2                 transformer.h.i.mlp.c_fc, c_proj (transposed)
    norm_f                                transformer.ln_f

GPT-2's Conv1D stores (in, out) matrices: ours are their transposes. Its scores' scale is
head_dim^-1/2 (scale_attn_weights), divided by layer + 1 with scale_attn_by_inverse_layer_idx;
reorder_and_upcast_attn changes only the precision of half-precision scores.
"""

from __future__ import annotations

from torch import nn

from mecheval.layers.grouped_attention import GroupedQueryAttention
from mecheval.layers.mlp import ACTIVATIONS, MLP
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


def check(config, source: str) -> None:
    """Refuse the options of a GPT-2 config mecheval does not build."""
    require(not config.add_cross_attention, source, "cross-attention is not supported")
    act = config.activation_function
    require(act in ACTIVATIONS, source, f"activation_function {act!r} is not supported")


def _block(config, layer: int) -> PreNormBlock:
    d, eps = config.n_embd, config.layer_norm_epsilon
    scale = config.n_embd // config.n_head
    scale = scale**-0.5 if config.scale_attn_weights else 1.0
    if config.scale_attn_by_inverse_layer_idx:
        scale /= layer + 1
    mixer = GroupedQueryAttention(d, config.n_head, qkv_bias=True, out_bias=True, scale=scale)
    hidden = config.n_inner if config.n_inner is not None else 4 * d
    mlp = MLP(d, hidden=hidden, act=config.activation_function)
    return PreNormBlock(mixer, nn.LayerNorm(d, eps=eps), nn.LayerNorm(d, eps=eps), mlp)


def _state(weights: Weights, config, hf_model) -> dict:
    """Our names -> the checkpoint's tensors (rearranged where GPT-2 lays them out otherwise)."""
    state = {
        "embedding.weight": weights.take("transformer.wte.weight"),
        "position_embedding.weight": weights.take("transformer.wpe.weight"),
        "norm_f.weight": weights.take("transformer.ln_f.weight"),
        "norm_f.bias": weights.take("transformer.ln_f.bias"),
        **head_of(weights, hf_model),
    }
    for i in range(config.n_layer):
        theirs, ours = f"transformer.h.{i}.", f"layers.{i}."
        for a, b in (("ln_1", "norm1"), ("ln_2", "norm2")):
            for p in ("weight", "bias"):
                state[f"{ours}{b}.{p}"] = weights.take(f"{theirs}{a}.{p}")
        qkv_weight = weights.take(f"{theirs}attn.c_attn.weight").t().chunk(3, dim=0)
        qkv_bias = weights.take(f"{theirs}attn.c_attn.bias").chunk(3, dim=0)
        for name, w, b in zip(("q_proj", "k_proj", "v_proj"), qkv_weight, qkv_bias, strict=True):
            state[f"{ours}mixer.{name}.weight"] = w.contiguous()
            state[f"{ours}mixer.{name}.bias"] = b.contiguous()
        for a, b in (("attn.c_proj", "mixer.o_proj"), ("mlp.c_fc", "mlp.fc1")) + (
            ("mlp.c_proj", "mlp.fc2"),
        ):
            state[f"{ours}{b}.weight"] = weights.take(f"{theirs}{a}.weight").t().contiguous()
            state[f"{ours}{b}.bias"] = weights.take(f"{theirs}{a}.bias")
    return state


def convert(hf_model, source: str, max_len: int | None = None) -> PretrainedModel:
    """Our model of a transformers GPT2LMHeadModel (its tensors shared where their layout is
    ours: see mecheval.models.pretrained.convert)."""
    config = hf_model.config
    check(config, source)
    d, vocab = config.n_embd, config.vocab_size
    ours = PretrainedConfig(
        "gpt2", source, vocab, d, config.n_layer, max_len or config.n_positions, tied(hf_model)
    )
    if ours.max_len > config.n_positions:
        raise ValueError(f"max_len {ours.max_len} exceeds GPT-2's n_positions {config.n_positions}")

    parts = on_meta(
        lambda: {
            "embedding": nn.Embedding(vocab, d),
            "position_embedding": nn.Embedding(ours.max_len, d),
            "layers": [_block(config, i) for i in range(config.n_layer)],
            "norm_f": nn.LayerNorm(d, eps=config.layer_norm_epsilon),
            "lm_head": head_module(hf_model, vocab, d),
        }
    )
    weights = Weights(hf_model.state_dict(), source)
    state = _state(weights, config, hf_model)
    weights.check_all_used()
    state["position_embedding.weight"] = state["position_embedding.weight"][: ours.max_len]
    return assemble(ours, parts, state)
