"""Associative treecall documents: format, queries against the sampler's own trees, holdout,
determinism, corruption and the rejection bound."""

import pytest
import torch

from mecheval.tasks import make_task
from tests.tasks.oracles import check_derivation, pair_score

STUDY_SETTINGS = [
    {"max_rhs_len": 5, "num_terminals": 20},
    {"max_rhs_len": 10, "num_terminals": 20},
    {"max_rhs_len": 5, "num_terminals": 8192, "terminal_factor": 20},
    {"max_rhs_len": 10, "num_terminals": 8192, "terminal_factor": 20},
]


def check_documents(task, batch, trees):
    """Walk every document and compare with the study's definition (docs/study.md) and the
    sampler's tree."""
    first, last = 3, 3 + task.num_terminals
    for i, row in enumerate(batch.tokens.tolist()):
        length = int(batch.lengths[i])
        n = length - 5
        assert 3 <= n <= task.max_length
        assert row[0] == task.BOS and row[n + 1] == task.EOS and row[n + 4] == task.EOS
        assert all(token == task.PAD for token in row[length:])
        sentence = row[1 : n + 1]
        assert all(first <= token < last for token in sentence)
        key, value = int(batch.positions["key"][i]), int(batch.positions["value"][i])
        positions = {name: int(batch.positions[name][i]) for name in ("divider", "query", "answer")}
        assert positions == {"divider": n + 1, "query": n + 2, "answer": n + 3}
        child, parent = row[n + 2], row[n + 3]
        assert int(batch.answers[i]) == parent
        assert row[key] == child and row[value] == parent
        # The query is the rightmost occurrence of its terminal in the sentence.
        assert max(p for p in range(1, n + 1) if row[p] == child) == key
        # The answer is the query's parent in the tree the sampler built, to its right.
        parents = trees.parents[i].tolist()
        assert parents[key] == value and value > key
        assert all(p == -1 for p in parents[:1] + parents[n + 1 :])
        # That tree is a derivation of the grammar.
        check_derivation(
            task.grammar,
            [token - first for token in sentence],
            [p - 1 if p >= 0 else -1 for p in parents[1 : n + 1]],
            trees.head_nonterminal[i, 1 : n + 1].tolist(),
            trees.head_rule[i, 1 : n + 1].tolist(),
        )


@pytest.mark.parametrize(
    "options", STUDY_SETTINGS, ids=lambda o: f"{o['max_rhs_len']}x{o['num_terminals']}"
)
def test_study_settings_generate_well_formed_documents(options):
    task = make_task("atr", **options)
    batch, trees = task.sample_with_trees(150, seed=0)
    assert len(batch) == 150 and batch.tokens.dtype == torch.long
    assert batch.width == int(batch.lengths.max())
    assert task.vocab_size == options["num_terminals"] + 6
    check_documents(task, batch, trees)
    assert batch.equals(task.sample(150, seed=0))


def test_terminal_factor_defaults():
    assert make_task("atr", max_rhs_len=5, num_terminals=20).terminal_factor is None
    assert make_task("atr", max_rhs_len=5, num_terminals=8192).terminal_factor == 20.0
    explicit = make_task("atr", max_rhs_len=5, num_terminals=8192, terminal_factor=None)
    assert explicit.terminal_factor is None
    assert (
        make_task("atr", max_rhs_len=5, num_terminals=20, terminal_factor=3).terminal_factor == 3.0
    )


def test_short_max_length_bounds_every_sentence():
    task = make_task("atr", max_rhs_len=10, num_terminals=20, max_length=12)
    batch, trees = task.sample_with_trees(200, seed=1)
    assert int(batch.lengths.max()) <= 12 + 5 and int(batch.lengths.min()) >= 3 + 5
    check_documents(task, batch, trees)


def test_query_choice_uses_targets_beyond_the_root():
    """Values are not always the root: many parent positions get queried."""
    task = make_task("atr", max_rhs_len=10, num_terminals=20)
    batch = task.sample(400, seed=2)
    is_root = batch.positions["value"] == batch.lengths - 6
    assert 0.05 < is_root.double().mean() < 0.95


def held_out(task, parent_token, child_token):
    holdout = task.pairs_held_out
    return pair_score(holdout, parent_token - 3, child_token - 3) < int(holdout.threshold)


def test_holdout_keeps_train_dev_and_test_query_pairs_disjoint():
    task = make_task("atr", max_rhs_len=5, num_terminals=20, holdout=0.2)
    assert task.pairs_held_out.held_out_count() == 80
    pairs = {}
    for split in ("train", "dev", "test"):
        batch, trees = task.sample_with_trees(300, seed=0, split=split)
        check_documents(task, batch, trees)
        rows = batch.tokens.tolist()
        queries = [
            row[int(column)] for row, column in zip(rows, batch.positions["query"], strict=True)
        ]
        pairs[split] = set(zip(batch.answers.tolist(), queries, strict=True))
        for parent, child in pairs[split]:
            assert held_out(task, parent, child) == (split == "test")
    assert not (pairs["train"] | pairs["dev"]) & pairs["test"]
    assert len(pairs["test"]) > 10


def test_determinism_seeds_splits_and_prefixes():
    task = make_task("atr", max_rhs_len=10, num_terminals=20)
    first = task.sample(50, seed=3)
    assert first.equals(make_task("atr", max_rhs_len=10, num_terminals=20).sample(50, seed=3))
    assert first.equals(task.sample(3000, seed=3)[:50].trim())
    for other in (task.sample(50, seed=4), task.sample(50, seed=3, split="dev")):
        assert not first.equals(other)
    other_grammar = make_task("atr", max_rhs_len=10, num_terminals=20, seed=1)
    assert not first.equals(other_grammar.sample(50, seed=3))


def test_grammar_seed_fixes_the_grammar():
    a = make_task("atr", max_rhs_len=5, num_terminals=20, seed=7).grammar
    b = make_task("atr", max_rhs_len=5, num_terminals=20, seed=7).grammar
    c = make_task("atr", max_rhs_len=5, num_terminals=20, seed=8).grammar
    assert (a.head_probs == b.head_probs).all() and (a.body_symbol == b.body_symbol).all()
    assert not (a.head_probs == c.head_probs).all()


@pytest.mark.parametrize("num_terminals", [20, 8192])
def test_corrupt_changes_exactly_one_token_to_another_terminal(num_terminals):
    task = make_task("atr", max_rhs_len=5, num_terminals=num_terminals)
    batch = task.sample(300, seed=0)
    rows = torch.arange(len(batch))
    for at in ("key", "value"):
        corrupted = task.corrupt(batch, at, seed=9)
        changed = corrupted != batch.tokens
        assert (changed.sum(1) == 1).all() and changed[rows, batch.positions[at]].all()
        new = corrupted[rows, batch.positions[at]]
        assert ((new >= 3) & (new < 3 + num_terminals)).all()
        assert torch.equal(corrupted, task.corrupt(batch, at, seed=9))
        assert task.corruption_metadata(at) == {
            "at": at,
            "replacement_low": 3,
            "replacement_high": 3 + num_terminals,
        }


def test_impossible_grammar_raises_a_clear_error():
    # Every body has one terminal and no nonterminal: all sentences have 2 tokens (< 3).
    task = make_task("atr", max_rhs_len=2, num_terminals=20, max_depth=1)
    with pytest.raises(RuntimeError, match="shorter than 3"):
        task.sample(10, seed=0)


def test_format_names_terminals_and_reserved_ids():
    task = make_task("atr", max_rhs_len=5, num_terminals=20)
    assert task.format([1, 3, 22, 2, 3, 22, 2, 0]) == "BOS t0 t19 EOS t0 t19 EOS"
    assert task.token_name(23) == "q0" and task.token_name(25) == "q2"
    with pytest.raises(ValueError):
        task.token_name(26)
