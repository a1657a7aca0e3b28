"""Independent, plain-Python checks that the task tests compare the fast code against."""

from __future__ import annotations

from mecheval.tasks.grammar import Grammar
from mecheval.tasks.holdout import PairHoldout

MASK64 = (1 << 64) - 1


def splitmix64_finaliser(value: int) -> int:
    """SplitMix64's output mixing step on Python ints (the published constants)."""
    value &= MASK64
    value ^= value >> 30
    value = (value * 0xBF58476D1CE4E5B9) & MASK64
    value ^= value >> 27
    value = (value * 0x94D049BB133111EB) & MASK64
    return value ^ (value >> 31)


def pair_score(holdout: PairHoldout, left: int, right: int) -> int:
    """The score the holdout module docstring defines, computed with Python ints."""
    offset = (holdout.salt * 0x9E3779B97F4A7C15) & MASK64
    return splitmix64_finaliser(left * holdout.num_right + right + offset)


def held_out_pairs_by_rank(holdout: PairHoldout) -> set[tuple[int, int]]:
    """For a small space: the round(fraction * N) pairs of smallest score, by sorting."""
    pairs = [(a, b) for a in range(holdout.num_left) for b in range(holdout.num_right)]
    pairs.sort(key=lambda pair: pair_score(holdout, *pair))
    return set(pairs[: round(holdout.fraction * len(pairs))])


def check_derivation(
    grammar: Grammar,
    terminals: list[int],
    parents: list[int],
    head_nonterminal: list[int],
    head_rule: list[int],
) -> None:
    """Assert that annotated tokens form a derivation of `grammar` from some start
    nonterminal (each sentence draws its own, so any nonterminal may head the root).

    Args:
        terminals: terminal index of each sentence token.
        parents: parent position of each token (-1 for the root).
        head_nonterminal: nonterminal whose head each token is, -1 for body terminals.
        head_rule: flat rule index that nonterminal used, -1 for body terminals.
    """
    length = len(terminals)
    assert parents[-1] == -1, "the last token must be the root"
    assert sum(parent == -1 for parent in parents) == 1, "exactly one root"
    assert 0 <= head_nonterminal[-1] < grammar.num_nonterminals, "the root heads a nonterminal"
    children: dict[int, list[int]] = {position: [] for position in range(length)}
    for position, parent in enumerate(parents):
        if parent >= 0:
            assert parent > position, "a parent stands to the right of its child"
            children[parent].append(position)
    for position in range(length):
        nonterminal = head_nonterminal[position]
        if nonterminal < 0:
            assert not children[position], "a body terminal has no children"
            continue
        rule = head_rule[position]
        assert grammar.rule_owner[rule] == nonterminal, "the rule belongs to the nonterminal"
        assert grammar.head_probs[nonterminal, terminals[position]] > 0
        span = slice(grammar.body_first[rule], grammar.body_first[rule + 1])
        body = list(zip(grammar.body_is_nonterminal[span], grammar.body_symbol[span], strict=True))
        kids = children[position]
        assert len(kids) == len(body), "one child per body symbol"
        for kid, (is_nonterminal, symbol) in zip(kids, body, strict=True):
            if is_nonterminal:
                assert head_nonterminal[kid] == symbol, "child constituent of the right kind"
            else:
                assert head_nonterminal[kid] == -1 and terminals[kid] == symbol
        # The constituent is contiguous: its yield is exactly the span ending at its head.
        subtree = _subtree(children, position)
        assert subtree == set(range(min(subtree), position + 1)), "constituents are contiguous"
    assert _subtree(children, length - 1) == set(range(length)), "the root spans the sentence"


def _subtree(children: dict[int, list[int]], root: int) -> set[int]:
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        seen.add(node)
        stack.extend(children[node])
    return seen
