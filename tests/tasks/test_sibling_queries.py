"""ATR sibling queries (`query="sibling"`, the study's sibling experiments): the vectorised
choice against the plain reference, documents against the sampler's own trees, and the
parent-query task left as it was."""

import numpy as np
import pytest

from mecheval.tasks import make_task
from mecheval.tasks.tree_reference import choose_query_reference, eligible_sibling_targets
from mecheval.tasks.tree_sampler import (
    choose_queries,
    rightmost_occurrence,
    rightmost_sibling,
)
from tests.tasks.oracles import check_derivation
from tests.tasks.test_tree_sampler import fast_sentences

SIBLING = {"max_rhs_len": 5, "num_terminals": 20, "query": "sibling"}


def test_rightmost_sibling_matches_python():
    # Sentence 0: 0, 1 children of 2; 2, 3 children of 4 (the root). Sentence 1: 0 child of 1.
    sentence_ids = np.array([0, 0, 0, 0, 0, 1, 1])
    positions = np.array([0, 1, 2, 3, 4, 0, 1])
    parents = np.array([2, 2, 4, 4, -1, 1, -1])
    got = rightmost_sibling(sentence_ids, positions, parents)
    assert got.tolist() == [1, 1, 3, 3, 4, 0, 1]


@pytest.mark.parametrize("num_terminals", [6, 20])
def test_sibling_choice_matches_the_reference_choice(num_terminals):
    task = make_task("atr", max_rhs_len=10, num_terminals=num_terminals, seed=2)
    sentences, block = fast_sentences(task.grammar, 200, 300, seed=3)
    rng = np.random.default_rng(1)
    target_draw, query_draw = rng.random(len(sentences)), rng.random(len(sentences))
    sentence_ids = block.sentence_ids
    targets = rightmost_sibling(sentence_ids, block.positions, block.parents)
    eligible = rightmost_occurrence(sentence_ids, block.terminals, num_terminals)
    eligible &= eligible[block.offsets[sentence_ids] + targets]
    chosen = choose_queries(
        sentence_ids, targets, eligible, len(sentences), target_draw, query_draw
    )
    answers_itself = 0
    for i, (terminals, parents, *_) in enumerate(sentences):
        reference = eligible_sibling_targets(terminals, parents)
        expected = choose_query_reference(reference, target_draw[i], query_draw[i])
        assert expected is not None  # the root (last token) is always its own eligible target
        query = int(chosen[i] - block.offsets[i])
        assert (query, int(targets[chosen[i]])) == expected
        answers_itself += expected[0] == expected[1]
    assert 0 < answers_itself < len(sentences)


def test_sibling_documents_answer_the_rightmost_sibling():
    task = make_task("atr", **SIBLING)
    batch, trees = task.sample_with_trees(300, seed=0)
    first = 3
    for i, row in enumerate(batch.tokens.tolist()):
        n = int(batch.lengths[i]) - 5
        assert row[0] == task.BOS and row[n + 1] == task.EOS and row[n + 4] == task.EOS
        key, value = int(batch.positions["key"][i]), int(batch.positions["value"][i])
        positions = {name: int(batch.positions[name][i]) for name in ("divider", "query", "answer")}
        assert positions == {"divider": n + 1, "query": n + 2, "answer": n + 3}
        query, answer = row[n + 2], row[n + 3]
        assert row[key] == query and row[value] == answer and int(batch.answers[i]) == answer
        sentence = row[1 : n + 1]
        # Query and answer are the rightmost occurrences of their terminals.
        for token, column in ((query, key), (answer, value)):
            assert max(p for p in range(1, n + 1) if row[p] == token) == column
        # The answer is the rightmost token sharing the query's parent (itself included).
        parents = trees.parents[i].tolist()
        if parents[key] >= 0:
            family = [p for p in range(1, n + 1) if parents[p] == parents[key]]
            assert value == max(family)
        else:
            assert key == value == n  # the root answers itself
        check_derivation(
            task.grammar,
            [token - first for token in sentence],
            [p - 1 if p >= 0 else -1 for p in parents[1 : n + 1]],
            trees.head_nonterminal[i, 1 : n + 1].tolist(),
            trees.head_rule[i, 1 : n + 1].tolist(),
        )
    same = batch.positions["key"] == batch.positions["value"]
    assert 0.05 < same.double().mean() < 0.95


def test_sibling_option_is_part_of_the_data_identity_only_when_set():
    parent = make_task("atr", max_rhs_len=5, num_terminals=20)
    explicit = make_task("atr", max_rhs_len=5, num_terminals=20, query="parent")
    sibling = make_task("atr", **SIBLING)
    assert "query" not in parent.config() and explicit == parent
    assert (
        explicit.key() == parent.key() and parent.label() == "atr(max_rhs_len=5, num_terminals=20)"
    )
    assert sibling.config()["query"] == "sibling" and sibling.key() != parent.key()
    assert make_task("atr", **sibling.config()) == sibling
    assert not sibling.sample(50, seed=0).equals(parent.sample(50, seed=0))
    assert sibling.sample(50, seed=0).equals(make_task("atr", **SIBLING).sample(50, seed=0))


def test_bad_sibling_options_are_refused():
    with pytest.raises(ValueError, match="option 'query' must be one of"):
        make_task("atr", max_rhs_len=5, num_terminals=20, query="child")
    with pytest.raises(ValueError, match="not offered with query='sibling'"):
        make_task("atr", **SIBLING, holdout=0.2)
