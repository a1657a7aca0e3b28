"""DeltaNet and Gated DeltaNet (mecheval/models/pretrained/fla.py): our models of random fla
DeltaNetForCausalLM and GatedDeltaNetForCausalLM give, within 2e-5 in float32 (the naive
recurrences' own rounding: helpers.FLA_LOGITS_ATOL), the logits of fla's models whose layers run
fla's naive recurrences (fla_reference.py: fla's own layers need CUDA), for their options; the
options we do not build are refused by name."""

from __future__ import annotations

import pytest

from mecheval.models.pretrained import from_pretrained
from mecheval.models.pretrained.families import check
from mecheval.models.pretrained.synthetic import random_hf_model
from tests.models.pretrained.helpers import FLA_LOGITS_ATOL, logits_gap

VARIANTS = {
    ("delta_net", "default"): {},  # silu, l2, beta, short convs, untied
    ("delta_net", "elu_sum_negative_tied"): {
        "qk_activation": "elu",
        "qk_norm": "sum",
        "allow_neg_eigval": True,
        "tie_word_embeddings": True,
        "expand_k": 0.5,
    },
    ("delta_net", "no_conv_no_beta"): {"use_short_conv": False, "use_beta": False},
    ("gated_deltanet", "default"): {},  # gated output norm, expand_v 1
    ("gated_deltanet", "wide_values_negative"): {
        "expand_v": 2.0,
        "allow_neg_eigval": True,
        "conv_size": 3,
        "norm_eps": 1e-3,
    },
    ("gated_deltanet", "no_gate_no_conv"): {"use_gate": False, "use_short_conv": False},
}


@pytest.mark.parametrize("family, variant", VARIANTS)
def test_logits_equal_flas_naive_recurrences(family, variant):
    hf = random_hf_model(family, **VARIANTS[family, variant])
    model = from_pretrained(hf)
    assert logits_gap(hf, model) <= FLA_LOGITS_ATOL
    assert "layers.1.state" in model.site_names()
    assert model.config.tied == hf.config.tie_word_embeddings


def test_refuses_what_it_does_not_build():
    with pytest.raises(ValueError, match="output gate \\(use_gate\\) is not supported"):
        from_pretrained(random_hf_model("delta_net", use_gate=True))
    with pytest.raises(ValueError, match="num_v_heads != num_heads"):
        from_pretrained(random_hf_model("gated_deltanet", num_heads=1, num_v_heads=2))
    from fla.models import DeltaNetConfig  # (fla builds hybrid attention with flash-attn alone)

    config = DeltaNetConfig(attn={"layers": [1], "num_heads": 2})
    with pytest.raises(ValueError, match="x: hybrid attention layers \\(attn\\)"):
        check(config, "x")
