"""PretrainedModel and PretrainedConfig (mecheval/models/pretrained/model.py): a converted model
keeps the LanguageModel contract the grid relies on, for every family: a run in segments,
resumed from the contexts the first leaves, equals one run; the logits at one position per row
equal the full logits there; the head is the checkpoint's own where untied."""

from __future__ import annotations

import pytest
import torch

from mecheval.models.pretrained import FAMILIES, PretrainedConfig, from_pretrained
from mecheval.models.pretrained.synthetic import random_batch, random_hf_model


@pytest.mark.parametrize("family", FAMILIES)
def test_segments_and_read_out_equal_one_run(family):
    model = from_pretrained(random_hf_model(family, seed=3))
    tokens = torch.randint(0, model.config.vocab_size, (3, 19), generator=torch.Generator())
    with torch.no_grad():
        whole = model(tokens)
        residual = model.embed(tokens)
        first, contexts = model.resume_from(0, residual[:, :7])
        second, _ = model.resume_from(0, residual[:, 7:], contexts)
        at = torch.tensor([18, 4, 11])
        picked = model(tokens, at=at)
    assert model.can_resume(0)
    torch.testing.assert_close(torch.cat([first, second], 1), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(picked, whole[torch.arange(3), at], atol=1e-5, rtol=1e-5)


def test_the_head_is_the_checkpoints_own_where_untied():
    hf = random_hf_model("llama")
    model = from_pretrained(hf)
    assert model.unembedding.data_ptr() == hf.lm_head.weight.data_ptr()  # shared, not copied
    assert model.embedding.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tied = from_pretrained(random_hf_model("gpt2"))
    assert tied.lm_head is None and tied.unembedding is tied.embedding.weight


def test_config_refuses_bad_fields():
    fields = dict(source="x", vocab_size=5, d_model=4, n_layers=1, max_len=8, tied=True)
    with pytest.raises(ValueError, match="unknown family 'bert'"):
        PretrainedConfig("bert", **fields)
    with pytest.raises(ValueError, match="d_model must be >= 1, got 0"):
        PretrainedConfig("gpt2", **{**fields, "d_model": 0})


def test_random_batch_is_recall_shaped():
    batch, corrupted = random_batch(11, n=5, length=9, seed=4)
    rows, p = torch.arange(5), batch.positions
    assert torch.equal(batch.tokens[rows, p["query"]], batch.tokens[rows, p["key"]])
    assert torch.equal(batch.answers, batch.tokens[rows, p["value"]])
    differs = (batch.tokens != corrupted).nonzero()
    assert torch.equal(differs[:, 1], p["key"]) and int(batch.tokens.min()) >= 1
