"""DeltaNet and Gated DeltaNet (flash-linear-attention's `DeltaNetForCausalLM`,
`GatedDeltaNetForCausalLM`): pre-RMSNorm blocks of mecheval's DeltaNet or GatedDeltaNet layer and
a gated (SwiGLU) MLP, a final RMSNorm, an output head of its own unless tie_word_embeddings.

    ours                                  fla's
    embedding                             model.embeddings
    layers.i.norm1, norm2                 model.layers.i.attn_norm, mlp_norm
    layers.i.mixer.*                      model.layers.i.attn.* (fla's layer names)
    layers.i.mlp.{gate,up,down}_proj      model.layers.i.mlp.{gate,up,down}_proj
    norm_f, lm_head                       model.norm, lm_head

mecheval's layers take fla's parameter names and run the delta rules through mecheval_kernels:
the grid reads and patches the state inside them. fla's own forward needs CUDA (Triton); on CPU
our models are checked against fla's naive recurrences (docs/pretrained.md). Not built: hybrid
attention layers (config.attn), attention residuals (attnres_block_size), DeltaNet's output gate
(use_gate), Gated DeltaNet's grouped value heads (num_v_heads) and sigmoid output gate.
"""

from __future__ import annotations

from torch import nn

from mecheval.layers.delta_net import DeltaNet
from mecheval.layers.gated_delta_net import GatedDeltaNet
from mecheval.layers.mlp import GatedMLP
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
from mecheval.models.pretrained.model import UNBOUNDED, PretrainedConfig, PretrainedModel


def check(config, source: str) -> None:
    """Refuse the options of an fla DeltaNet or Gated DeltaNet config mecheval does not build."""
    require(getattr(config, "attn", None) is None, source, "hybrid attention layers (attn)")
    attnres = getattr(config, "attnres_block_size", None)
    require(attnres is None, source, "attention residuals (attnres_block_size)")
    act = config.hidden_act
    require(act == "swish", source, f"hidden_act {act!r} is not supported (fla's MLP: swish)")
    if config.model_type == "delta_net":
        require(not config.use_gate, source, "DeltaNet's output gate (use_gate) is not supported")
        return
    v_heads = getattr(config, "num_v_heads", None)
    require(v_heads in (None, config.num_heads), source, "num_v_heads != num_heads")
    gate = getattr(config, "output_gate_activation", "swish")
    require(gate in ("swish", "silu"), source, f"output_gate_activation {gate!r}")


def _mixer(config, layer: int) -> DeltaNet | GatedDeltaNet:
    common = {
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "use_short_conv": config.use_short_conv,
        "conv_size": config.conv_size,
        "allow_neg_eigval": config.allow_neg_eigval,
        "norm_eps": config.norm_eps,
        "layer_idx": layer,
    }
    if config.model_type == "delta_net":
        return DeltaNet(
            expand_k=config.expand_k,
            expand_v=config.expand_v,
            use_beta=config.use_beta,
            qk_activation=config.qk_activation,
            qk_norm=config.qk_norm,
            **common,
        )
    return GatedDeltaNet(
        expand_v=config.expand_v, head_dim=config.head_dim, use_gate=config.use_gate, **common
    )


def _block(config, layer: int, hidden: int) -> PreNormBlock:
    d, eps = config.hidden_size, config.norm_eps
    mlp = GatedMLP(d, hidden, "swish")
    return PreNormBlock(_mixer(config, layer), nn.RMSNorm(d, eps=eps), nn.RMSNorm(d, eps=eps), mlp)


def convert(hf_model, source: str, max_len: int | None = None) -> PretrainedModel:
    """Our model of an fla DeltaNetForCausalLM or GatedDeltaNetForCausalLM (tensors shared)."""
    config = hf_model.config
    check(config, source)
    d, vocab, n = config.hidden_size, config.vocab_size, config.num_hidden_layers
    ours = PretrainedConfig(
        config.model_type, source, vocab, d, n, max_len or UNBOUNDED, tied(hf_model)
    )
    hidden = hf_model.model.layers[0].mlp.gate_proj.out_features  # fla rounds it to 256s
    parts = on_meta(
        lambda: {
            "embedding": nn.Embedding(vocab, d),
            "layers": [_block(config, i, hidden) for i in range(n)],
            "norm_f": nn.RMSNorm(d, eps=config.norm_eps),
            "lm_head": head_module(hf_model, vocab, d),
        }
    )
    weights = Weights(hf_model.state_dict(), source)
    state = {
        "embedding.weight": weights.take("model.embeddings.weight"),
        "norm_f.weight": weights.take("model.norm.weight"),
        **head_of(weights, hf_model),
    }
    for i, block in enumerate(parts["layers"]):
        theirs, ours_ = f"model.layers.{i}.", f"layers.{i}."
        for a, b in (("attn_norm.", "norm1."), ("attn.", "mixer."), ("mlp_norm.", "norm2.")):
            state.update(weights.like(getattr(block, b[:-1]), theirs + a, ours_ + b))
        state.update(weights.like(block.mlp, f"{theirs}mlp.", f"{ours_}mlp."))
    weights.check_all_used()
    return assemble(ours, parts, state)
