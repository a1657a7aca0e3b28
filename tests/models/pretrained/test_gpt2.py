"""GPT-2 (mecheval/models/pretrained/gpt2.py): our model of a random transformers
GPT2LMHeadModel gives its logits within 1e-5 in float32, for its options; the options we do not
build are refused by name."""

from __future__ import annotations

import pytest

from mecheval.models.pretrained import from_pretrained
from mecheval.models.pretrained.synthetic import random_hf_model
from tests.models.pretrained.helpers import LOGITS_ATOL, logits_gap

VARIANTS = {
    "default": {},  # gelu_new, tied head, head_dim^-1/2
    "untied_gelu_inner": {
        "tie_word_embeddings": False,
        "activation_function": "gelu",
        "n_inner": 40,
        "scale_attn_by_inverse_layer_idx": True,
        "layer_norm_epsilon": 1e-3,
    },
    "unscaled_relu": {"scale_attn_weights": False, "activation_function": "relu", "n_layer": 3},
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_equal_transformers(variant):
    hf = random_hf_model("gpt2", **VARIANTS[variant])
    model = from_pretrained(hf)
    assert logits_gap(hf, model) <= LOGITS_ATOL
    assert model.config.tied == hf.config.tie_word_embeddings
    assert model.num_params() == sum(p.numel() for p in hf.parameters())


def test_refuses_what_it_does_not_build():
    with pytest.raises(ValueError, match="GPT2LMHeadModel: cross-attention is not supported"):
        from_pretrained(random_hf_model("gpt2", add_cross_attention=True))
    hf = random_hf_model("gpt2")
    hf.config.activation_function = "quick_gelu"
    with pytest.raises(ValueError, match="activation_function 'quick_gelu' is not supported"):
        from_pretrained(hf)
    with pytest.raises(ValueError, match="exceeds GPT-2's n_positions 1024"):
        from_pretrained(random_hf_model("gpt2"), max_len=2048)
    with pytest.raises(TypeError, match="expected a Hugging Face model object"):
        from_pretrained(3)
