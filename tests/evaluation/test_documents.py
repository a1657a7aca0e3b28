"""mecheval/evaluation/documents.py: the evaluation documents and what a model answers on each.
`document_records` against the logits of a full forward (argmax and softmax at the query,
taken here), on a multi-answer task; `evaluation_documents` against the task's own corruption
and roles."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mecheval.evaluation.config import EvaluateConfig, OptionError
from mecheval.evaluation.documents import document_records, evaluation_documents
from mecheval.models import build_model
from mecheval.tasks import make_task


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MECHEVAL_CACHE", str(tmp_path / "cache"))


def test_records_equal_the_full_forward_at_each_query():
    task = make_task("mqar", vocab_size=64, input_seq_len=32, num_kv_pairs=4)
    batch = task.sample(12, seed=0, split="dev")
    torch.manual_seed(0)
    model = build_model("mamba", task.vocab_size, 16, max_len=task.max_document_length)
    records = document_records(model, batch)

    rows = torch.arange(len(batch))
    with torch.no_grad():
        logits = model(batch.tokens)[rows, batch.positions["query"]]
    probs = logits.softmax(-1)[rows, batch.answers]
    assert len(records) == len(batch) == 12 * 4  # a row per (document, query)
    assert (records["correct"].to_numpy() == (logits.argmax(-1) == batch.answers).numpy()).all()
    np.testing.assert_allclose(records["p_answer"], probs.numpy(), rtol=1e-5, atol=1e-7)
    query, key = batch.positions["query"].numpy(), batch.positions["key"].numpy()
    assert (records["distance"].to_numpy() == query - key).all()
    assert (records["document"].to_numpy() == batch.documents().numpy()).all()
    assert model.training  # left as it was found


def test_documents_are_the_tasks_corruption_and_positions_are_checked():
    task = make_task("ar", num_pairs=4, num_keys=16)
    options = EvaluateConfig(positions=["key", "query", "value+1"], corruptions=["key"], seed=3)
    docs = evaluation_documents(task, 16, options)
    batch = task.dataset("dev", size=16)
    assert torch.equal(docs.batch.tokens, batch.tokens)
    assert torch.equal(docs.corrupted["key"], task.corrupt(batch, "key", seed=3))
    assert [labels for labels, _ in docs.groups] == [["key", "query", "value+1"]]
    assert docs.skipped == {}

    with pytest.raises(OptionError, match="'qurey' is not a position of ar's documents"):
        evaluation_documents(task, 16, EvaluateConfig(positions=["qurey"]))
    with pytest.raises(OptionError, match="'divider' is not a corruption of ar"):
        evaluation_documents(task, 16, EvaluateConfig(corruptions=["divider"]))
    with pytest.raises(OptionError, match="'query\\+40' lies outside every dev document"):
        evaluation_documents(task, 16, EvaluateConfig(positions=["query+40"]))
