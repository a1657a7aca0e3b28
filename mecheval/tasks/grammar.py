"""The random probabilistic grammar behind associative treecall (docs/study.md).

`sample_grammar` builds one grammar from its own seed:

- each of the `num_nonterminals` nonterminals gets a depth score uniform in `1..max_depth`; a
  rule of X may use only nonterminals of greater score (so there is no recursion and a
  derivation is at most `max_depth` levels deep);
- each nonterminal gets a uniform `1..max_rules` number of rules, each body a uniform length in
  `1..max_rhs_len - 1`; a body symbol is drawn i.i.d.: with a terminal factor r, each allowed
  nonterminal has weight 1 and one terminal slot weight r (the slot then holds a uniformly
  random terminal); without r, uniform over the allowed nonterminals and all terminals;
- rule probabilities of a nonterminal ~ Dirichlet(1), its head distribution over terminals
  ~ Dirichlet(1).

The grammar has no fixed start symbol: as in the study's generator (its start distribution is
uniform over the nonterminals and is sampled anew for every sentence), the sampler draws each
sentence's start nonterminal uniformly (see `tree_sampler.py`).

The grammar is stored as flat arrays (rules grouped by owner, bodies concatenated) so that the
vectorised sampler can index it; `rules_of` gives the readable view.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True, eq=False)
class Grammar:
    """A sampled grammar as flat arrays (N nonterminals, T terminals, R rules, S body symbols).

    Attributes:
        num_terminals: T; terminals are numbered `0..T-1` (token id = 3 + terminal).
        depth_scores: `(N,)` int64, each in `1..max_depth`.
        rule_owner: `(R,)` int64, the nonterminal a rule rewrites; rules are grouped by owner.
        rule_first: `(N + 1,)` int64, the rules of X are `rule_first[X]:rule_first[X + 1]`.
        rule_probs: `(R,)` float64, summing to 1 over each owner's rules.
        body_first: `(R + 1,)` int64, the body of rule r is `body_first[r]:body_first[r + 1]`.
        body_is_nonterminal: `(S,)` bool.
        body_symbol: `(S,)` int64, a nonterminal index or a terminal index.
        head_probs: `(N, T)` float64, each row the head distribution of a nonterminal.
    """

    num_terminals: int
    depth_scores: np.ndarray
    rule_owner: np.ndarray
    rule_first: np.ndarray
    rule_probs: np.ndarray
    body_first: np.ndarray
    body_is_nonterminal: np.ndarray
    body_symbol: np.ndarray
    head_probs: np.ndarray

    @property
    def num_nonterminals(self) -> int:
        return len(self.depth_scores)

    @property
    def body_lengths(self) -> np.ndarray:
        """`(R,)` int64 body length of each rule."""
        return np.diff(self.body_first)

    def rules_of(self, nonterminal: int) -> list[tuple[float, list[tuple[str, int]]]]:
        """The rules of one nonterminal as `(probability, [("N", X) | ("T", t), ...])`."""
        rules = []
        for rule in range(self.rule_first[nonterminal], self.rule_first[nonterminal + 1]):
            span = slice(self.body_first[rule], self.body_first[rule + 1])
            body = [
                ("N" if is_nonterminal else "T", int(symbol))
                for is_nonterminal, symbol in zip(
                    self.body_is_nonterminal[span], self.body_symbol[span], strict=True
                )
            ]
            rules.append((float(self.rule_probs[rule]), body))
        return rules


class GrammarOptions(NamedTuple):
    """The options a grammar is drawn with (mecheval's draw and the study's).

    Attributes:
        num_nonterminals: N >= 1.
        num_terminals: T >= 1.
        max_rhs_len: bodies have length `1..max_rhs_len - 1`; >= 2.
        terminal_factor: weight r of the terminal slot, or None for uniform symbols.
        max_depth: depth scores are uniform in `1..max_depth`.
        max_rules: rules per nonterminal are uniform in `1..max_rules`.
    """

    num_nonterminals: int
    num_terminals: int
    max_rhs_len: int
    terminal_factor: float | None
    max_depth: int
    max_rules: int


def sample_grammar(rng: np.random.Generator, options: GrammarOptions) -> Grammar:
    """Draw a grammar as described in the module docstring, from `rng` (seeded from the task's
    grammar seed)."""
    num_nonterminals, num_terminals, max_rhs_len, terminal_factor, max_depth, max_rules = options
    depth_scores = rng.integers(1, max_depth + 1, size=num_nonterminals)
    rule_owner, rule_probs, body_first = [], [], [0]
    body_is_nonterminal: list[bool] = []
    body_symbol: list[int] = []
    for owner in range(num_nonterminals):
        allowed = np.flatnonzero(depth_scores > depth_scores[owner])
        num_rules = int(rng.integers(1, max_rules + 1))
        for _ in range(num_rules):
            length = int(rng.integers(1, max_rhs_len))
            for _ in range(length):
                if terminal_factor is not None:
                    weight_total = len(allowed) + terminal_factor
                    is_terminal = rng.random() * weight_total < terminal_factor
                    if is_terminal:
                        symbol = int(rng.integers(0, num_terminals))
                    else:
                        symbol = int(allowed[rng.integers(0, len(allowed))])
                else:
                    choice = int(rng.integers(0, len(allowed) + num_terminals))
                    is_terminal = choice >= len(allowed)
                    symbol = choice - len(allowed) if is_terminal else int(allowed[choice])
                body_is_nonterminal.append(not is_terminal)
                body_symbol.append(symbol)
            body_first.append(len(body_symbol))
            rule_owner.append(owner)
        rule_probs.extend(rng.dirichlet(np.ones(num_rules)))
    head_probs = rng.dirichlet(np.ones(num_terminals), size=num_nonterminals)
    owners = np.asarray(rule_owner, dtype=np.int64)
    return Grammar(
        num_terminals=num_terminals,
        depth_scores=depth_scores.astype(np.int64),
        rule_owner=owners,
        rule_first=np.searchsorted(owners, np.arange(num_nonterminals + 1)).astype(np.int64),
        rule_probs=np.asarray(rule_probs, dtype=np.float64),
        body_first=np.asarray(body_first, dtype=np.int64),
        body_is_nonterminal=np.asarray(body_is_nonterminal, dtype=bool),
        body_symbol=np.asarray(body_symbol, dtype=np.int64),
        head_probs=head_probs,
    )
