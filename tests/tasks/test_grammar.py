"""The sampled grammar obeys every constraint of the study's grammar (docs/study.md)."""

import numpy as np
import pytest

from mecheval.tasks import make_task


@pytest.mark.parametrize(
    "options",
    [
        {"max_rhs_len": 5, "num_terminals": 20},
        {"max_rhs_len": 10, "num_terminals": 20, "seed": 3},
        {"max_rhs_len": 10, "num_terminals": 8192},
        {
            "max_rhs_len": 4,
            "num_terminals": 50,
            "num_nonterminals": 12,
            "max_depth": 3,
            "max_rules": 2,
        },
    ],
)
def test_grammar_constraints(options):
    task = make_task("atr", **options)
    grammar = task.grammar
    scores = grammar.depth_scores
    assert grammar.num_nonterminals == task.num_nonterminals
    assert ((scores >= 1) & (scores <= task.max_depth)).all()
    for owner in range(task.num_nonterminals):
        rules = grammar.rules_of(owner)
        assert 1 <= len(rules) <= task.max_rules
        assert abs(sum(p for p, _ in rules) - 1) < 1e-12 and all(p > 0 for p, _ in rules)
        for _, body in rules:
            assert 1 <= len(body) <= task.max_rhs_len - 1
            for kind, symbol in body:
                if kind == "N":
                    assert scores[symbol] > scores[owner]  # no recursion
                else:
                    assert 0 <= symbol < task.num_terminals
    assert grammar.head_probs.shape == (task.num_nonterminals, task.num_terminals)
    assert np.allclose(grammar.head_probs.sum(1), 1) and (grammar.head_probs > 0).all()


def expected_terminal_share(grammar, factor, num_terminals):
    """Chance that a body symbol of each slot's owner is a terminal, averaged over slots."""
    shares = []
    for owner in range(grammar.num_nonterminals):
        allowed = int((grammar.depth_scores > grammar.depth_scores[owner]).sum())
        share = factor / (allowed + factor) if factor else num_terminals / (allowed + num_terminals)
        slots = sum(len(body) for _, body in grammar.rules_of(owner))
        shares += [share] * slots
    return np.asarray(shares)


@pytest.mark.parametrize(
    "options",
    [
        {"max_rhs_len": 10, "num_terminals": 8192, "terminal_factor": 20},
        {"max_rhs_len": 10, "num_terminals": 20},
        {"max_rhs_len": 10, "num_terminals": 20, "terminal_factor": 2},
    ],
)
def test_terminal_slot_weight(options):
    """Pooled over several grammars, the terminal share of body symbols matches the weights."""
    observed, expected = [], []
    for seed in range(6):
        task = make_task("atr", seed=seed, **options)
        observed.append(~task.grammar.body_is_nonterminal)
        expected.append(
            expected_terminal_share(task.grammar, task.terminal_factor, task.num_terminals)
        )
    observed, expected = np.concatenate(observed), np.concatenate(expected)
    standard_error = (expected * (1 - expected)).sum() ** 0.5
    assert abs(observed.sum() - expected.sum()) < 5 * standard_error


def test_depth_scores_and_rule_counts_are_uniform_over_many_grammars():
    scores, rule_counts, body_lengths = [], [], []
    for seed in range(40):
        grammar = make_task("atr", max_rhs_len=5, num_terminals=20, seed=seed).grammar
        scores.append(grammar.depth_scores)
        rule_counts.append(np.diff(grammar.rule_first))
        body_lengths.append(grammar.body_lengths)
    for values, support in [(scores, 10), (rule_counts, 5), (body_lengths, 4)]:
        counts = np.bincount(np.concatenate(values) - 1, minlength=support)
        assert len(counts) == support
        expected = counts.sum() / support
        assert ((counts - expected) ** 2 / expected).sum() < 3 * support + 20
