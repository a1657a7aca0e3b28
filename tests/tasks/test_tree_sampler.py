"""The vectorised ATR sampler against the plain reference (`tree_reference.py`).

Exact checks where both consume the same draws (query choice, rightmost occurrence);
distribution checks (fixed seeds, tolerances of several standard errors) where they cannot.
"""

import random

import numpy as np
import pytest

from mecheval.tasks import make_task
from mecheval.tasks.tree_reference import (
    ReferenceTreeSampler,
    choose_query_reference,
    eligible_targets,
)
from mecheval.tasks.tree_sampler import TreeSampler, choose_queries, rightmost_occurrence
from tests.tasks.oracles import check_derivation


def reference_sentences(grammar, max_length, count, seed):
    sampler, rng = ReferenceTreeSampler(grammar, max_length), random.Random(seed)
    drawn = [sampler.sample(rng) for _ in range(count)]
    return [s for s in drawn if s is not None and len(s[0]) >= 3], drawn.count(None)


def fast_sentences(grammar, max_length, count, seed):
    block = TreeSampler(grammar, max_length).sample(np.random.default_rng(seed), count)
    sentences = [
        (
            block.terminals[a:b].tolist(),
            block.parents[a:b].tolist(),
            block.head_nonterminal[a:b].tolist(),
            block.head_rule[a:b].tolist(),
        )
        for a, b in zip(block.offsets[:-1], block.offsets[1:], strict=True)
    ]
    return sentences, block


def shape_statistics(sentences):
    """Per sentence: length, mean child-parent distance, share of tokens that are heads, and
    the terminals of the root and of the first token (sensitive to the head distributions)."""
    stats = {name: [] for name in ("length", "distance", "head_share", "root", "first")}
    for terminals, parents, *_ in sentences:
        stats["length"].append(len(terminals))
        stats["distance"].append(np.mean([p - i for i, p in enumerate(parents) if p >= 0]))
        stats["head_share"].append(len({p for p in parents if p >= 0}) / len(terminals))
        stats["root"].append(terminals[-1])
        stats["first"].append(terminals[0])
    return stats


@pytest.mark.parametrize("max_rhs_len, num_terminals", [(5, 20), (10, 20), (10, 8192)])
def test_fast_sampler_matches_the_reference_distribution(max_rhs_len, num_terminals):
    task = make_task("atr", max_rhs_len=max_rhs_len, num_terminals=num_terminals, seed=4)
    max_length = 200
    fast, block = fast_sentences(task.grammar, max_length, 3000, seed=0)
    reference, reference_too_long = reference_sentences(task.grammar, max_length, 3000, seed=0)
    fast_stats, reference_stats = shape_statistics(fast), shape_statistics(reference)
    for name in fast_stats:
        a, b = np.asarray(fast_stats[name]), np.asarray(reference_stats[name])
        standard_error = (a.var() / len(a) + b.var() / len(b)) ** 0.5 + 1e-12
        assert abs(a.mean() - b.mean()) < 5 * standard_error, name
    # The same share of draws is rejected as too long.
    p_fast, p_reference = block.num_too_long / 3000, reference_too_long / 3000
    pooled = (p_fast + p_reference) / 2
    assert abs(p_fast - p_reference) <= 5 * (2 * pooled * (1 - pooled) / 3000) ** 0.5 + 1e-9


@pytest.mark.parametrize("max_rhs_len, num_terminals", [(5, 20), (10, 20), (5, 8192)])
def test_fast_sampler_trees_are_derivations_of_the_grammar(max_rhs_len, num_terminals):
    task = make_task("atr", max_rhs_len=max_rhs_len, num_terminals=num_terminals, seed=1)
    sentences, block = fast_sentences(task.grammar, 300, 400, seed=2)
    assert sentences and block.num_too_long + block.num_too_short + len(sentences) == 400
    for sentence in sentences:
        assert 3 <= len(sentence[0]) <= 300
        check_derivation(task.grammar, *sentence)


def test_reference_sentences_are_derivations_too():
    """Sanity of the oracle itself: the reference's parents satisfy the structural checks."""
    task = make_task("atr", max_rhs_len=5, num_terminals=20, seed=1)
    for terminals, parents in reference_sentences(task.grammar, 300, 200, seed=1)[0]:
        assert parents[-1] == -1 and all(p > i for i, p in enumerate(parents[:-1]))
        assert 3 <= len(terminals) <= 300 and all(0 <= t < 20 for t in terminals)


def test_rightmost_occurrence_matches_python():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 30, size=50)
    sentence_ids = np.repeat(np.arange(50), lengths)
    terminals = rng.integers(0, 6, size=len(sentence_ids))
    got = rightmost_occurrence(sentence_ids, terminals, 6)
    expected = [
        not any(
            sentence_ids[j] == sentence_ids[i] and terminals[j] == terminals[i]
            for j in range(i + 1, len(terminals))
        )
        for i in range(len(terminals))
    ]
    assert got.tolist() == expected


@pytest.mark.parametrize("restrict", [False, True])
def test_choose_queries_matches_the_reference_choice(restrict):
    task = make_task("atr", max_rhs_len=10, num_terminals=20, seed=2)
    sentences, block = fast_sentences(task.grammar, 200, 300, seed=3)
    rng = np.random.default_rng(1)
    target_draw, child_draw = rng.random(len(sentences)), rng.random(len(sentences))
    # An arbitrary pair rule, to exercise targets whose children are only partly eligible.
    allowed = (lambda parent, child: (parent + 2 * child) % 3 != 0) if restrict else None
    sentence_ids = block.sentence_ids
    eligible = rightmost_occurrence(sentence_ids, block.terminals, 20) & (block.parents >= 0)
    if restrict:
        parent_terminal = block.terminals[block.offsets[sentence_ids] + block.parents]
        eligible &= (parent_terminal + 2 * block.terminals) % 3 != 0
    chosen = choose_queries(
        sentence_ids, block.parents, eligible, len(sentences), target_draw, child_draw
    )
    for i, (terminals, parents, *_) in enumerate(sentences):
        targets = (
            eligible_targets(terminals, parents, allowed)
            if allowed
            else eligible_targets(terminals, parents)
        )
        expected = choose_query_reference(targets, target_draw[i], child_draw[i])
        if expected is None:
            assert chosen[i] == -1
        else:
            child = int(chosen[i] - block.offsets[i])
            assert (child, parents[child]) == expected


def test_query_choice_is_uniform_over_targets_then_children():
    # Sentence: positions 0,1,2 are children of 3; 3 and 4 children of 5 (the root).
    parents = np.array([3, 3, 3, 5, 5, -1])
    draws = 60_000
    sentence_ids = np.repeat(np.arange(draws), 6)
    rng = np.random.default_rng(0)
    chosen = choose_queries(
        sentence_ids,
        np.tile(parents, draws),
        np.tile(parents >= 0, draws),
        draws,
        rng.random(draws),
        rng.random(draws),
    )
    counts = np.bincount(chosen - 6 * np.arange(draws), minlength=6)
    # Target 3 or 5 with 1/2 each; then children uniformly: 1/6, 1/6, 1/6, 1/4, 1/4.
    expected = draws * np.array([1 / 6, 1 / 6, 1 / 6, 1 / 4, 1 / 4, 0])
    assert counts[5] == 0
    assert (((counts[:5] - expected[:5]) ** 2) / expected[:5]).sum() < 25
