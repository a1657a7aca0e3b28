"""Mamba and Mamba-2 (mecheval/models/pretrained/mamba.py): our models of random transformers
MambaForCausalLM and Mamba2ForCausalLM give their logits within 1e-5 in float32 (mecheval's
Mamba and Mamba2 layers, their scans through mecheval_kernels), for their options; the options
we do not build are refused by name."""

from __future__ import annotations

import pytest

from mecheval.layers import Mamba, Mamba2
from mecheval.models.pretrained import from_pretrained
from mecheval.models.pretrained.synthetic import random_hf_model
from tests.models.pretrained.helpers import LOGITS_ATOL, logits_gap

VARIANTS = {
    ("mamba", "default"): {},  # tied head, conv bias, no in/out bias
    ("mamba", "untied_biases_conv3"): {
        "tie_word_embeddings": False,
        "use_bias": True,
        "conv_kernel": 3,
        "time_step_rank": 3,
        "layer_norm_epsilon": 1e-3,
    },
    ("mamba2", "default"): {},  # untied head, one group
    ("mamba2", "groups_tied_limits"): {
        "n_groups": 2,
        "tie_word_embeddings": True,
        "use_bias": True,
        "use_conv_bias": False,
        "time_step_limit": (0.01, 0.5),
        "layer_norm_epsilon": 1e-3,
    },
}


@pytest.mark.parametrize("family, variant", VARIANTS)
def test_logits_equal_transformers(family, variant):
    hf = random_hf_model(family, **VARIANTS[family, variant])
    model = from_pretrained(hf)
    assert logits_gap(hf, model) <= LOGITS_ATOL
    assert all(isinstance(b.mixer, Mamba if family == "mamba" else Mamba2) for b in model.layers)
    assert "layers.1.state" in model.site_names()
    assert model.config.tied == hf.config.tie_word_embeddings
    assert model.num_params() == sum(p.numel() for p in hf.parameters())


def test_refuses_what_it_does_not_build():
    with pytest.raises(ValueError, match="MambaForCausalLM: hidden_act 'gelu' is not supported"):
        from_pretrained(random_hf_model("mamba", hidden_act="gelu"))
    with pytest.raises(ValueError, match="conv_kernel 9 not in 1..8"):
        from_pretrained(random_hf_model("mamba2", conv_kernel=9))
