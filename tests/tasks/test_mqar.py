"""MQAR against zoology's layout, read off the documents: pairs then queries at even offsets,
keys from the lower half of the ids and values from the upper, each key queried once, the
query gaps drawn from the power law without replacement (checked against NumPy's own weighted
draw without replacement), random ids elsewhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mecheval.tasks import make_task
from mecheval.tasks.mqar import power_law


def _documents(task, n, seed=0, split="train"):
    batch = task.sample(n, seed, split)
    pairs = task.num_kv_pairs
    return batch, batch.tokens[::pairs], batch.positions["query"].view(n, pairs)


@pytest.mark.parametrize("passes", [1, 2])
def test_documents_are_laid_out_as_zoology_lays_them_out(passes):
    task = make_task("mqar", vocab_size=64, input_seq_len=48, num_kv_pairs=4, num_passes=passes)
    batch, docs, query = _documents(task, 200)
    half, context = 32, 8 * passes
    keys, values = docs[:, 0:8:2], docs[:, 1:8:2]
    assert ((keys >= 1) & (keys < half)).all() and ((values >= half) & (values < 64)).all()
    assert all(len(set(row.tolist())) == 4 for row in keys)
    assert all(len(set(row.tolist())) == 4 for row in values)
    assert torch.equal(docs[:, context - 8 : context], docs[:, :8])  # every pass the same
    assert (query >= context).all() and ((query - context) % 2 == 0).all()
    assert (query[:, 1:] > query[:, :-1]).all()  # rows in document order
    rows = torch.arange(len(batch))
    asked = batch.tokens[rows, batch.positions["query"]].view(-1, 4)
    assert torch.equal(asked.sort(1).values, keys.sort(1).values)  # each key once
    assert torch.equal(batch.tokens[rows, batch.positions["key"]], asked.view(-1))
    assert torch.equal(batch.answers, batch.tokens[rows, batch.positions["value"]])
    assert (batch.positions["key"] >= context - 8).all()  # the last pass's pair
    assert batch.lengths.eq(48).all() and batch.num_documents == 200


def test_non_query_positions_are_random_ids_or_zero():
    for random_ids in (True, False):
        task = make_task("mqar", vocab_size=64, input_seq_len=48, num_kv_pairs=4,
                         random_non_queries=random_ids)  # fmt: skip
        _, docs, query = _documents(task, 300)
        filler = torch.ones_like(docs, dtype=torch.bool)
        filler[:, :8] = False
        filler.scatter_(1, query, False)
        if random_ids:  # uniform over all 64 ids
            counts = torch.bincount(docs[filler], minlength=64).float()
            assert counts.min() > 0.6 * counts.mean() and counts.max() < 1.4 * counts.mean()
        else:
            assert (docs[filler] == 0).all()


def test_query_gaps_follow_the_power_law_without_replacement():
    """The frequency of each gap over all queries equals that of NumPy's own weighted draw
    of num_kv_pairs gaps without replacement (an independent implementation)."""
    task = make_task("mqar", vocab_size=128, input_seq_len=64, num_kv_pairs=4)
    n, space = 6000, (64 - 8) // 2
    _, _, query = _documents(task, n)
    ours = np.bincount(((query - 8) // 2).flatten().numpy(), minlength=space) / (4 * n)
    rng = np.random.default_rng(1)
    p = power_law(space, 0.01)
    draws = np.concatenate([rng.choice(space, size=4, replace=False, p=p) for _ in range(n)])
    theirs = np.bincount(draws, minlength=space) / (4 * n)
    assert 0.5 * np.abs(ours - theirs).sum() < 0.03  # total variation
    assert ours[:4].sum() > 4 * ours[-4:].sum()  # most queries close to the pairs


def test_the_power_law_is_zoologys():
    p = power_law(5, 0.01)
    expected = 0.01 * np.arange(1, 6) ** (0.01 - 1)
    np.testing.assert_allclose(p, expected / expected.sum())


def test_corruptions_draw_from_their_own_kind():
    task = make_task("mqar", vocab_size=64, input_seq_len=48, num_kv_pairs=4)
    batch = task.sample(50, 0, "dev")
    rows = torch.arange(len(batch))
    for name, (low, high) in (("key", (1, 32)), ("value", (32, 64))):
        corrupted = task.corrupt(batch, name, seed=0)
        at = batch.positions[name]
        assert (corrupted != batch.tokens).sum(1).eq(1).all()
        drawn = corrupted[rows, at]
        assert ((drawn >= low) & (drawn < high)).all() and (drawn != batch.tokens[rows, at]).all()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"input_seq_len": 63}, "must be even"),
        ({"vocab_size": 32, "input_seq_len": 64}, "must exceed input_seq_len"),
        ({"num_kv_pairs": 20, "input_seq_len": 64}, "need input_seq_len >= 80"),
        ({"power_a": 0}, "power_a' must be > 0"),
    ],
)
def test_impossible_settings_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        make_task("mqar", **options)
