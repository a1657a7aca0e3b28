"""Associative recall: document format, answers, positions, holdout, determinism, corruption.

Every check walks documents in plain Python and compares with the study's definition
(docs/study.md).
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mecheval.tasks import AssociativeRecall, make_task
from mecheval.tasks.associative_recall import sample_distinct_rows
from tests.tasks.oracles import pair_score

K = 4096
FIRST_VALUE = 3 + K


def pairs_of(row: list[int], num_pairs: int = 16) -> list[tuple[int, int]]:
    return [(row[1 + 2 * j], row[2 + 2 * j]) for j in range(num_pairs)]


@pytest.fixture(scope="module")
def ar_batch():
    return make_task("ar").sample(600, seed=3)


def test_vocabulary_and_layout_constants():
    task = make_task("ar")
    assert (task.PAD, task.BOS, task.EOS) == (0, 1, 2)
    assert task.vocab_size == 8195
    assert task.token_range("key") == (3, 4099) and task.token_range("value") == (4099, 8195)
    # The study's corruption (the default): keys replace keys and values alike.
    assert task.corruption_range == "query"
    assert task.replacement_range("key") == task.replacement_range("value") == (3, 4099)
    own = make_task("ar", corruption_range="own")
    assert own.replacement_range("key") == (3, 4099)
    assert own.replacement_range("value") == (4099, 8195)


def test_format_bos_eos_and_token_ranges(ar_batch):
    tokens = ar_batch.tokens
    assert tokens.shape == (600, 37) and tokens.dtype == torch.long
    assert (tokens[:, 0] == 1).all() and (tokens[:, 33] == 2).all() and (tokens[:, 36] == 2).all()
    assert (ar_batch.lengths == 37).all()
    keys, values = tokens[:, 1:33:2], tokens[:, 2:33:2]
    assert ((keys >= 3) & (keys < FIRST_VALUE)).all()
    assert ((values >= FIRST_VALUE) & (values < 8195)).all()
    # No special token inside the pairs or the query.
    assert (tokens[:, 1:33] > 2).all() and (tokens[:, 34:36] > 2).all()


def test_keys_distinct_and_values_distinct_within_each_document(ar_batch):
    for row in ar_batch.tokens.tolist():
        pairs = pairs_of(row)
        assert len({k for k, _ in pairs}) == 16
        assert len({v for _, v in pairs}) == 16


def test_answer_is_the_value_of_the_queried_key_and_positions_agree(ar_batch):
    for i, row in enumerate(ar_batch.tokens.tolist()):
        query, answer = row[34], row[35]
        mapping = dict(pairs_of(row))
        assert answer == mapping[query] == int(ar_batch.answers[i])
        key_position = row.index(query)
        assert int(ar_batch.positions["key"][i]) == key_position
        assert int(ar_batch.positions["value"][i]) == key_position + 1
        assert row[key_position + 1] == answer
    fixed = {"divider": 33, "query": 34, "answer": 35}
    for name, column in fixed.items():
        assert (ar_batch.positions[name] == column).all()


def test_query_pair_and_contents_look_uniform(ar_batch):
    big = make_task("ar").sample(8000, seed=11)
    queried_pair = ((big.positions["key"] - 1) // 2).numpy()
    counts = np.bincount(queried_pair, minlength=16)
    expected = 8000 / 16
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 45  # 15 degrees of freedom; p ~ 1e-4
    keys = big.tokens[:, 1:33:2].double() - 3
    assert abs(keys.mean().item() - (K - 1) / 2) < 5 * (K / 12**0.5) / (keys.numel() ** 0.5)


def test_value_first_queries_ask_for_the_key_of_a_value():
    task = make_task("ar", query="value")
    batch = task.sample(300, seed=0)
    for i, row in enumerate(batch.tokens.tolist()):
        query, answer = row[34], row[35]
        assert query >= FIRST_VALUE and 3 <= answer < FIRST_VALUE
        inverse = {v: k for k, v in pairs_of(row)}
        assert answer == inverse[query] == int(batch.answers[i])
        assert row[int(batch.positions["key"][i])] == answer
        assert row[int(batch.positions["value"][i])] == query


def test_other_sizes_follow_the_same_layout():
    task = make_task("ar", num_pairs=4, num_keys=6)
    batch = task.sample(500, seed=1)
    assert batch.tokens.shape == (500, 13) and task.vocab_size == 15
    for row in batch.tokens.tolist():
        pairs = pairs_of(row, 4)
        assert len({k for k, _ in pairs}) == 4 and len({v for _, v in pairs}) == 4
        assert dict(pairs)[row[10]] == row[11] and row[9] == row[12] == 2


def test_determinism_seeds_splits_and_prefixes():
    task = make_task("ar")
    first = task.sample(100, seed=5)
    assert first.equals(task.sample(100, seed=5))
    assert first.equals(make_task("ar").sample(100, seed=5))
    assert not torch.equal(first.tokens, task.sample(100, seed=6).tokens)
    assert not torch.equal(first.tokens, task.sample(100, seed=5, split="dev").tokens)
    assert not torch.equal(first.tokens, task.sample(100, seed=5, split="test").tokens)
    assert first.equals(task.sample(5000, seed=5)[:100])  # a stream, not a size-dependent draw
    assert not torch.equal(first.tokens, make_task("ar", query="value").sample(100, 5).tokens)


def held_out(task: AssociativeRecall, key_token: int, value_token: int) -> bool:
    holdout = task.pairs_held_out
    return pair_score(holdout, key_token - 3, value_token - FIRST_VALUE) < int(holdout.threshold)


def test_holdout_train_and_dev_never_contain_a_held_out_pair_and_test_queries_one():
    task = make_task("ar", holdout=0.2)
    seen_in_training = set()
    for split in ("train", "dev"):
        for row in task.sample(250, seed=2, split=split).tokens.tolist():
            for key, value in pairs_of(row):
                assert not held_out(task, key, value)
                seen_in_training.add((key, value))
    test = task.sample(250, seed=2, split="test")
    queried = set()
    unrestricted_held = 0
    for row in test.tokens.tolist():
        query, answer = row[34], row[35]
        assert held_out(task, query, answer)
        queried.add((query, answer))
        unrestricted_held += sum(held_out(task, k, v) for k, v in pairs_of(row))
    assert not queried & seen_in_training
    # Other pairs of a test document are unrestricted: about 20% of 15 per document are held out.
    assert 250 * 15 * 0.15 < unrestricted_held - 250 < 250 * 15 * 0.25
    for row in test.tokens.tolist():
        pairs = pairs_of(row)
        assert len({k for k, _ in pairs}) == 16 and len({v for _, v in pairs}) == 16


def test_holdout_value_first_applies_to_key_value_pairs():
    task = make_task("ar", holdout=0.2, query="value")
    for row in task.sample(100, seed=0, split="test").tokens.tolist():
        assert held_out(task, row[35], row[34])


@pytest.mark.parametrize(
    "corruption_range, value_range",
    [("query", (3, FIRST_VALUE)), ("own", (FIRST_VALUE, 8195))],
)
def test_corrupt_changes_exactly_the_named_token_within_its_range(
    ar_batch, corruption_range, value_range
):
    task = make_task("ar", corruption_range=corruption_range)
    for at, (low, high) in [("key", (3, FIRST_VALUE)), ("value", value_range)]:
        corrupted = task.corrupt(ar_batch, at, seed=0)
        assert corrupted.shape == ar_batch.tokens.shape and corrupted.dtype == torch.long
        changed = corrupted != ar_batch.tokens
        assert (changed.sum(1) == 1).all()
        rows = torch.arange(len(ar_batch))
        column = ar_batch.positions[at]
        assert changed[rows, column].all()
        new = corrupted[rows, column]
        assert ((new >= low) & (new < high)).all()
        assert torch.equal(corrupted, task.corrupt(ar_batch, at, seed=0))
        assert not torch.equal(corrupted, task.corrupt(ar_batch, at, seed=1))
    assert ar_batch.tokens[0, 0] == 1  # the batch itself is untouched


def test_corrupt_replacements_cover_the_range_uniformly():
    task = make_task("ar", num_pairs=2, num_keys=4)
    batch = task.sample(4000, seed=0)
    corrupted = task.corrupt(batch, "key", seed=3)
    rows = torch.arange(len(batch))
    original = batch.tokens[rows, batch.positions["key"]]
    new = corrupted[rows, batch.positions["key"]]
    for token in range(3, 7):
        # Given the original, the 3 other keys are equally likely.
        picks = new[original == token]
        counts = torch.bincount(picks - 3, minlength=4).double()
        assert counts[token - 3] == 0
        others = counts[torch.arange(4) != token - 3]
        expected = others.sum() / 3
        assert (((others - expected) ** 2) / expected).sum() < 20


def replacement_counts(task, batch, at, seed):
    """(original token, replacement token) of every document's corrupted position."""
    rows = torch.arange(len(batch))
    corrupted = task.corrupt(batch, at, seed=seed)
    column = batch.positions[at]
    return batch.tokens[rows, column], corrupted[rows, column]


def chi_square(counts):
    counts = counts.double()
    expected = counts.sum() / len(counts)
    return float(((counts - expected) ** 2 / expected).sum())


def test_value_corruption_draws_uniformly_from_the_keys_by_default():
    """The study's interchange draws the corrupting token from the key ids at the value too."""
    task = make_task("ar", num_pairs=2, num_keys=4)  # keys 3..6, values 7..10
    batch = task.sample(4000, seed=0)
    original, new = replacement_counts(task, batch, "value", seed=5)
    assert ((original >= 7) & (original < 11)).all()
    assert ((new >= 3) & (new < 7)).all() and (new != original).all()
    # Every key is possible (the original, a value, is not in the range): uniform over 4.
    counts = torch.bincount(new - 3, minlength=4)
    assert (counts > 0).all() and chi_square(counts) < 20
    assert task.corruption_metadata("value") == {
        "at": "value",
        "corruption_range": "query",
        "replacement_low": 3,
        "replacement_high": 7,
    }


def test_value_corruption_draws_other_values_with_the_own_range_option():
    task = make_task("ar", num_pairs=2, num_keys=4, corruption_range="own")
    batch = task.sample(4000, seed=0)
    original, new = replacement_counts(task, batch, "value", seed=5)
    assert ((new >= 7) & (new < 11)).all() and (new != original).all()
    for token in range(7, 11):
        counts = torch.bincount(new[original == token] - 7, minlength=4)
        assert counts[token - 7] == 0
        assert chi_square(counts[torch.arange(4) != token - 7]) < 20
    assert task.corruption_metadata("value")["corruption_range"] == "own"
    assert task.corruption_metadata("value")["replacement_low"] == 7


def test_value_first_variant_corrupts_both_positions_with_value_ids():
    """With value queries the study's corrupting range is the value ids (the query's kind)."""
    task = make_task("ar", num_pairs=2, num_keys=4, query="value")
    batch = task.sample(2000, seed=1)
    for at in ("key", "value"):
        original, new = replacement_counts(task, batch, at, seed=2)
        assert ((new >= 7) & (new < 11)).all() and (new != original).all()
    own = make_task("ar", num_pairs=2, num_keys=4, query="value", corruption_range="own")
    original, new = replacement_counts(own, batch, "key", seed=2)
    assert ((new >= 3) & (new < 7)).all() and (new != original).all()


def test_corrupt_skips_the_original_only_where_the_range_holds_it(monkeypatch):
    """A range that holds some originals (values 7, 8) and not others (9, 10)."""
    task = make_task("ar", num_pairs=2, num_keys=4)
    batch = task.sample(4000, seed=0)
    monkeypatch.setattr(AssociativeRecall, "replacement_range", lambda self, at: (5, 9))
    original, new = replacement_counts(task, batch, "value", seed=1)
    assert ((new >= 5) & (new < 9)).all() and (new != original).all()
    for token in range(7, 11):
        counts = torch.bincount(new[original == token] - 5, minlength=4)
        if token < 9:
            assert counts[token - 5] == 0 and chi_square(counts[torch.arange(4) != token - 5]) < 20
        else:
            assert chi_square(counts) < 20


def test_corruption_range_changes_no_document_and_is_visible_in_config_and_label():
    study, own = make_task("ar"), make_task("ar", corruption_range="own")
    assert study.key() == own.key()
    assert study.sample(50, seed=3).equals(own.sample(50, seed=3))
    assert study.config()["corruption_range"] == "query" and study.label() == "ar()"
    assert own.config()["corruption_range"] == "own"
    assert own.label() == "ar(corruption_range='own')"
    assert make_task("ar", **own.config()) == own and own != study
    # Key corruption is the same draw in both modes.
    batch = study.sample(100, seed=4)
    assert torch.equal(study.corrupt(batch, "key", 1), own.corrupt(batch, "key", 1))
    with pytest.raises(ValueError, match="corruption_range"):
        make_task("ar", corruption_range="value_range")


def test_corrupt_refuses_bad_positions_and_foreign_batches(ar_batch):
    task = make_task("ar")
    with pytest.raises(ValueError, match="no corruption 'query'; its corruptions: key, value"):
        task.corrupt(ar_batch, "query", seed=0)
    with pytest.raises(ValueError, match="outside"):
        make_task("ar", num_keys=100).corrupt(ar_batch, "key", seed=0)


def test_format_names_tokens():
    task = make_task("ar", num_pairs=2, num_keys=10)
    text = task.format(torch.tensor([1, 3, 13, 12, 22, 2, 12, 22, 2, 0, 0]))
    assert text == "BOS k0 v0 k9 v9 EOS k9 v9 EOS"


def test_small_holdout_fractions_still_sample_every_split():
    """Even when some keys have no held-out value, test queries draw from held-out pairs."""
    task = make_task("ar", holdout=0.0005)
    test = task.sample(300, seed=0, split="test")
    for row in test.tokens.tolist():
        assert held_out(task, row[34], row[35])
        pairs = pairs_of(row)
        assert len({k for k, _ in pairs}) == 16 and len({v for _, v in pairs}) == 16
    for row in task.sample(100, seed=0, split="train").tokens.tolist():
        assert not any(held_out(task, k, v) for k, v in pairs_of(row))


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 50),
    width=st.integers(1, 20),
    extra=st.integers(0, 500),
    seed=st.integers(0, 2**32),
)
def test_sample_distinct_rows_gives_distinct_in_range_values(rows, width, extra, seed):
    high = width + extra
    out = sample_distinct_rows(np.random.default_rng(seed), rows, width, high)
    assert out.shape == (rows, width)
    assert ((out >= 0) & (out < high)).all()
    assert all(len(set(row)) == width for row in out.tolist())


# The study's value-first generator as its ar_32_value runs used it, first document of seed 42:
# 16 (key, value) pairs, then EOS, query, answer, EOS; it queried pair 0 (key at 1, value at 2).
STUDY_SWAPPED_DOCUMENT = [1, 1302, 7276, 1341, 7776, 3876, 7253, 2086, 6919, 1501, 4801, 1969]
STUDY_SWAPPED_DOCUMENT += [6017, 3508, 4121, 2013, 7581, 99, 7204, 3516, 6915, 3011, 6471, 3333]
STUDY_SWAPPED_DOCUMENT += [5627, 3385, 6177, 1514, 7438, 1981, 7103, 1160, 6430, 2, 3180, 5398, 2]
STUDY_SWAPPED_KEY, STUDY_SWAPPED_VALUE = 1, 2


def swapped_query_and_answer(tokens: list[int], key: int, value: int) -> tuple[int, int]:
    """The rule read off the study's code: the query is the key id with the value's index, the
    answer the value id with the key's index."""
    return 3 + (tokens[value] - FIRST_VALUE), FIRST_VALUE + (tokens[key] - 3)


def test_the_swapped_rule_reproduces_the_studys_document():
    tokens = STUDY_SWAPPED_DOCUMENT
    assert swapped_query_and_answer(tokens, STUDY_SWAPPED_KEY, STUDY_SWAPPED_VALUE) == (
        tokens[34],
        tokens[35],
    )


def test_swapped_value_first_documents_follow_the_studys_rule():
    task = make_task("ar", query="value", query_ids="swapped")
    batch = task.sample(300, seed=0)
    for i, row in enumerate(batch.tokens.tolist()):
        key, value = int(batch.positions["key"][i]), int(batch.positions["value"][i])
        assert value == key + 1
        query, answer = swapped_query_and_answer(row, key, value)
        assert (row[34], row[35], int(batch.answers[i])) == (query, answer, answer)
        assert 3 <= row[34] < FIRST_VALUE <= row[35]  # a key id asks, a value id answers


def test_swapped_value_first_corrupts_both_positions_with_value_ids():
    task = make_task("ar", query="value", query_ids="swapped")
    batch = task.sample(200, seed=1)
    rows = torch.arange(200)
    for at in ("key", "value"):
        corrupted = task.corrupt(batch, at, seed=0)
        replaced = corrupted[rows, batch.positions[at]]
        assert ((replaced >= FIRST_VALUE) & (replaced < FIRST_VALUE + K)).all()
        assert (replaced != batch.tokens[rows, batch.positions[at]]).all()


def test_query_ids_option_is_checked_and_keeps_default_identities():
    assert "query_ids" not in make_task("ar", query="value").config()
    swapped = make_task("ar", query="value", query_ids="swapped")
    assert swapped.config()["query_ids"] == "swapped"
    assert swapped.key() != make_task("ar", query="value").key()
    with pytest.raises(ValueError, match="needs query='value'"):
        make_task("ar", query_ids="swapped")
    with pytest.raises(ValueError, match="option 'query_ids' must be"):
        make_task("ar", query="value", query_ids="shifted")
