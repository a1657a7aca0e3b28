"""Llama (mecheval/models/pretrained/llama.py): our model of a random transformers
LlamaForCausalLM gives its logits within 1e-5 in float32, for grouped key/value heads, biases,
a head_dim of its own, tied or untied heads and the static rotary types; the rotary types that
change with the length are refused by name."""

from __future__ import annotations

import pytest

from mecheval.models.pretrained import from_pretrained
from mecheval.models.pretrained.synthetic import random_hf_model
from tests.models.pretrained.helpers import LOGITS_ATOL, logits_gap

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16}  # fmt: skip
VARIANTS = {
    "default": {},  # 2 query heads per key/value head, untied, no biases
    "biases_tied_llama3": {
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
        "rope_parameters": LLAMA3,
    },
    "head_dim_yarn_one_kv_head": {
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 6,
        "rope_parameters": YARN,  # cos and sin scaled by its attention factor
        "hidden_act": "gelu",
    },
    "linear": {"rope_parameters": {"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0}},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers(variant):
    hf = random_hf_model("llama", **VARIANTS[variant])
    model = from_pretrained(hf)
    assert logits_gap(hf, model, length=40) <= LOGITS_ATOL
    assert model.config.tied == hf.config.tie_word_embeddings
    assert model.num_params() == sum(p.numel() for p in hf.parameters())


def test_refuses_what_it_does_not_build():
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="LlamaForCausalLM: rope_type 'dynamic' is not supported"):
        from_pretrained(random_hf_model("llama", rope_parameters=dynamic))
    with pytest.raises(ValueError, match="hidden_act 'gelu_10' is not supported"):
        from_pretrained(random_hf_model("llama", hidden_act="gelu_10"))
