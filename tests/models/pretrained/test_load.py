"""from_pretrained (mecheval/models/pretrained/load.py): a checkpoint folder written by
save_pretrained loads into a model with transformers' logits; what is missing (the folder, its
config or weights, a weight, the hub, flash-linear-attention) is said in one line."""

from __future__ import annotations

import sys

import huggingface_hub
import pytest
import torch
from safetensors.torch import load_file, save_file

from mecheval.models.pretrained import from_pretrained
from mecheval.models.pretrained.synthetic import random_hf_model
from tests.models.pretrained.helpers import logits_gap, parity_bar


@pytest.mark.parametrize("family", ["gpt2", "mamba", "gated_deltanet"])
def test_a_saved_folder_loads_with_its_logits(family, tmp_path):
    hf = random_hf_model(family, tie_word_embeddings=family == "mamba")
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert model.config.source == str(tmp_path) and model.config.family == family
    assert logits_gap(hf, model) <= parity_bar(family)
    assert next(model.parameters()).dtype == torch.float32
    half = from_pretrained(f"hf:{tmp_path}", dtype=torch.bfloat16, max_len=64)
    assert next(half.parameters()).dtype == torch.bfloat16 and half.config.max_len == 64


def test_a_folder_without_what_a_checkpoint_needs_is_named(tmp_path):
    with pytest.raises(ValueError, match="no folder ./no/such/folder"):
        from_pretrained("./no/such/folder")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file: pass the folder"):
        from_pretrained(tmp_path / "weights.bin")
    with pytest.raises(ValueError, match="no config.json in"):
        from_pretrained(tmp_path)
    random_hf_model("gpt2").save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["transformer.h.1.mlp.c_fc.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights \(transformer.h.1.mlp.c_fc.weight\)"):
        from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights in .* \\(model.safetensors or pytorch"):
        from_pretrained(tmp_path)


def test_without_the_hub_one_line_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ValueError) as error:
        from_pretrained("state-spaces/mamba-130m-hf")
    message = str(error.value)
    assert message.startswith("state-spaces/mamba-130m-hf is no local folder, and the Hugging")
    assert "\n" not in message and "put config.json and the weights" in message


def test_an_fla_checkpoint_without_fla_says_so(tmp_path, monkeypatch):
    random_hf_model("delta_net").save_pretrained(tmp_path)
    monkeypatch.setitem(sys.modules, "fla.models", None)
    with pytest.raises(ValueError, match="flash-linear-attention delta_net checkpoint: install"):
        from_pretrained(tmp_path)


def test_an_unknown_family_is_named(tmp_path):
    import transformers

    config = transformers.GPTNeoXConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt_neox' is not supported; from_pretrained"):
        from_pretrained(tmp_path)
