"""Plain reference for ATR sentence and query sampling: the study's procedure
(docs/study.md), one sentence at a time, written for reading rather than speed. Tests compare
the vectorised sampler (`tree_sampler.py`) against it.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable

from mecheval.tasks.grammar import Grammar


class _TooLong(Exception):
    pass


class ReferenceTreeSampler:
    """Leftmost-first recursive expansion of a grammar (docs/study.md).

    Args:
        grammar: the grammar.
        max_length: sentences longer than this are rejected (None returned).
    """

    def __init__(self, grammar: Grammar, max_length: int) -> None:
        self.grammar = grammar
        self.max_length = max_length
        self._rules = [grammar.rules_of(x) for x in range(grammar.num_nonterminals)]
        self._rule_cdf = [list(itertools.accumulate(p for p, _ in rules)) for rules in self._rules]
        self._head_cdf = [list(itertools.accumulate(row)) for row in grammar.head_probs.tolist()]

    @staticmethod
    def _draw(cdf: list[float], rng: random.Random) -> int:
        return min(bisect.bisect_right(cdf, rng.random() * cdf[-1]), len(cdf) - 1)

    def sample(self, rng: random.Random) -> tuple[list[int], list[int]] | None:
        """One sentence: `(terminals, parents)` with parent positions (-1 for the root), or
        None when it grows past `max_length`. Its start nonterminal is drawn uniformly among
        all nonterminals, anew for every sentence."""
        terminals: list[int] = []
        parents: list[int] = []

        def expand(nonterminal: int) -> int:
            _, body = self._rules[nonterminal][self._draw(self._rule_cdf[nonterminal], rng)]
            children = []
            for kind, symbol in body:
                if kind == "T":
                    terminals.append(symbol)
                    parents.append(-1)
                    children.append(len(terminals) - 1)
                else:
                    children.append(expand(symbol))
                if len(terminals) > self.max_length:
                    raise _TooLong
            terminals.append(self._draw(self._head_cdf[nonterminal], rng))
            parents.append(-1)
            head = len(terminals) - 1
            for child in children:
                parents[child] = head
            return head

        start = rng.randrange(self.grammar.num_nonterminals)
        try:
            expand(start)
        except _TooLong:
            return None
        if len(terminals) > self.max_length:
            return None
        return terminals, parents


def eligible_targets(
    terminals: list[int],
    parents: list[int],
    pair_allowed: Callable[[int, int], bool] = lambda parent, child: True,
) -> dict[int, list[int]]:
    """Eligible queries of one sentence: parent position -> its eligible child positions.

    A child is eligible when it has a parent, is the rightmost occurrence of its terminal and
    `pair_allowed(parent terminal, child terminal)` holds. Keys and lists are in position order.
    """
    last = {terminal: position for position, terminal in enumerate(terminals)}
    targets: dict[int, list[int]] = {}
    for position, (terminal, parent) in enumerate(zip(terminals, parents, strict=True)):
        if parent >= 0 and last[terminal] == position and pair_allowed(terminals[parent], terminal):
            targets.setdefault(parent, []).append(position)
    return dict(sorted(targets.items()))


def choose_query_reference(
    targets: dict[int, list[int]], target_draw: float, child_draw: float
) -> tuple[int, int] | None:
    """The study's choice: a target uniformly (by `target_draw`), then one of its children
    uniformly (by `child_draw`). Returns `(child position, parent position)` or None."""
    if not targets:
        return None
    parent = list(targets)[int(target_draw * len(targets))]
    children = targets[parent]
    return children[int(child_draw * len(children))], parent


def eligible_sibling_targets(terminals: list[int], parents: list[int]) -> dict[int, list[int]]:
    """Eligible sibling queries of one sentence (the study's sibling queries): target position
    -> its eligible query positions.

    A query's target is the rightmost of the tokens sharing its parent, itself included (the
    root, which has no parent, and a token with no sibling to its right are their own targets).
    A pair is eligible when the query and the target are each the rightmost occurrence of their
    terminal. Keys and lists are in position order.
    """
    last = {terminal: position for position, terminal in enumerate(terminals)}
    targets: dict[int, list[int]] = {}
    for query, parent in enumerate(parents):
        target = query
        if parent >= 0:
            target = max(p for p, other in enumerate(parents) if other == parent)
        if last[terminals[query]] == query and last[terminals[target]] == target:
            targets.setdefault(target, []).append(query)
    return dict(sorted(targets.items()))
