"""Vectorised sampling of grammar sentences with their dependency trees (docs/study.md).

The study describes a leftmost-first recursive expansion, one sentence at a time (that
procedure is written out plainly in `tree_reference.py`). Every expansion of a nonterminal is
independent of the others, so the same distribution over trees can be drawn level by level for
a whole block of sentences at once: all nonterminals at depth d, across all sentences, pick
their rule and head terminal in one NumPy call. The left-to-right layout (each constituent is
its body's yield followed by its head terminal) is then computed from subtree sizes: bottom-up
sizes, top-down start offsets.

Each sentence starts from its own nonterminal, drawn uniformly among all nonterminals (the
study's generator does the same for every sentence, rejected redraws included); a start whose
derivations are all shorter than 3 tokens only ever yields rejected sentences.

Sentences whose token count passes `max_length` stop growing as soon as that happens and are
reported as too long; `max_length` therefore also bounds the work per sentence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mecheval.tasks.grammar import Grammar


@dataclass(frozen=True)
class SentenceBlock:
    """Sampled sentences, flattened (M tokens in all, sentence i at `offsets[i]:offsets[i+1]`).

    Attributes:
        offsets: `(B + 1,)` int64.
        terminals: `(M,)` int64 terminal index (token id minus 3) of each token.
        parents: `(M,)` int64, position of the token's parent within its sentence, -1 for the
            root (the sentence's last token).
        head_nonterminal: `(M,)` int64, the nonterminal whose head the token is, or -1 for a
            terminal written in a rule body. The root's entry (a sentence's last token) is the
            sentence's start nonterminal.
        head_rule: `(M,)` int64, the rule that nonterminal expanded with, or -1.
        num_too_long: raw draws dropped for passing `max_length`.
        num_too_short: raw draws dropped for having fewer than `min_length` tokens.
    """

    offsets: np.ndarray
    terminals: np.ndarray
    parents: np.ndarray
    head_nonterminal: np.ndarray
    head_rule: np.ndarray
    num_too_long: int
    num_too_short: int

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def sentence_ids(self) -> np.ndarray:
        """`(M,)` int64, the sentence each token belongs to."""
        return np.repeat(np.arange(len(self.offsets) - 1), self.lengths)

    @property
    def positions(self) -> np.ndarray:
        """`(M,)` int64, each token's position within its sentence."""
        return np.arange(len(self.terminals)) - np.repeat(self.offsets[:-1], self.lengths)


def _exclusive_cumsum(values: np.ndarray) -> np.ndarray:
    out = np.zeros(len(values), dtype=np.int64)
    np.cumsum(values[:-1], out=out[1:])
    return out


@dataclass
class _Level:
    """The nonterminal nodes at one depth and the body slots they expand into."""

    node_sentence: np.ndarray  # (K,)
    node_nonterminal: np.ndarray  # (K,)
    node_rule: np.ndarray  # (K,)
    node_head: np.ndarray  # (K,) head terminal
    slot_owner: np.ndarray  # (S,) node (index in this level) of each body slot, grouped
    owner_first_slot: np.ndarray  # (K,) first slot of each node
    slot_is_nonterminal: np.ndarray  # (S,)
    slot_symbol: np.ndarray  # (S,)
    slot_child: np.ndarray  # (S,) node index in the next level, or -1


class TreeSampler:
    """Draws blocks of sentences from one grammar.

    Args:
        grammar: the grammar.
        max_length: longest sentence kept, in tokens.
        min_length: shortest sentence kept (3 in the study).
    """

    def __init__(self, grammar: Grammar, max_length: int, min_length: int = 3) -> None:
        self.grammar = grammar
        self.max_length = max_length
        self.min_length = min_length
        num_terminals = grammar.num_terminals
        # Inverse-CDF tables with every owner shifted by its index, so one searchsorted call
        # samples rows of different owners: owner X's table spans (X, X + 1].
        within = np.zeros(len(grammar.rule_probs))
        for owner in range(grammar.num_nonterminals):
            span = slice(grammar.rule_first[owner], grammar.rule_first[owner + 1])
            within[span] = np.cumsum(grammar.rule_probs[span])
            within[grammar.rule_first[owner + 1] - 1] = 1.0
        self._rule_table = grammar.rule_owner + within
        head_cdf = np.cumsum(grammar.head_probs, axis=1)
        head_cdf[:, -1] = 1.0
        self._head_table = (np.arange(grammar.num_nonterminals)[:, None] + head_cdf).ravel()
        self._num_terminals = num_terminals
        self._body_lengths = grammar.body_lengths

    def _draw_rules_and_heads(
        self, rng: np.random.Generator, nonterminal: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        grammar = self.grammar
        draw = nonterminal + rng.random(len(nonterminal))
        rule = np.searchsorted(self._rule_table, draw, "right")
        # Guards against X + u rounding up to X + 1 (probability ~1e-15).
        rule = np.minimum(rule, grammar.rule_first[nonterminal + 1] - 1)
        draw = nonterminal + rng.random(len(nonterminal))
        flat = np.searchsorted(self._head_table, draw, "right")
        head = np.minimum(flat - nonterminal * self._num_terminals, self._num_terminals - 1)
        return rule, head

    def sample(self, rng: np.random.Generator, count: int) -> SentenceBlock:
        """Draw `count` sentences, each from a uniformly drawn start nonterminal; keep those
        with `min_length <= length <= max_length`.

        Returns:
            the kept sentences, in draw order, with their trees.
        """
        grammar = self.grammar
        levels: list[_Level] = []
        node_sentence = np.arange(count, dtype=np.int64)
        node_nonterminal = rng.integers(0, grammar.num_nonterminals, size=count, dtype=np.int64)
        num_tokens = np.ones(count, dtype=np.int64)  # the root's head
        alive = np.ones(count, dtype=bool)
        while node_sentence.size:
            rule, head = self._draw_rules_and_heads(rng, node_nonterminal)
            body_length = self._body_lengths[rule]
            slot_owner = np.repeat(np.arange(len(rule)), body_length)
            owner_first_slot = _exclusive_cumsum(body_length)
            symbol_index = (
                grammar.body_first[rule][slot_owner]
                + np.arange(len(slot_owner))
                - owner_first_slot[slot_owner]
            )
            slot_is_nonterminal = grammar.body_is_nonterminal[symbol_index]
            slot_symbol = grammar.body_symbol[symbol_index]
            slot_sentence = node_sentence[slot_owner]
            # Each slot adds one token: a body terminal, or the head of a child constituent.
            num_tokens += np.bincount(slot_sentence, minlength=count)
            alive &= num_tokens <= self.max_length
            grows = slot_is_nonterminal & alive[slot_sentence]
            slot_child = np.where(grows, np.cumsum(grows) - 1, -1)
            levels.append(
                _Level(
                    node_sentence,
                    node_nonterminal,
                    rule,
                    head,
                    slot_owner,
                    owner_first_slot,
                    slot_is_nonterminal,
                    slot_symbol,
                    slot_child,
                )
            )
            node_sentence = slot_sentence[grows]
            node_nonterminal = slot_symbol[grows]
        kept = alive & (num_tokens >= self.min_length)
        return self._lay_out(levels, count, kept, int((~alive).sum()), int((alive & ~kept).sum()))

    def _lay_out(
        self, levels: list[_Level], count: int, kept: np.ndarray, too_long: int, too_short: int
    ) -> SentenceBlock:
        # Bottom-up: size of each constituent = 1 (its head) + the sizes of its body slots.
        # A nonterminal slot without a child (its sentence died) counts 1; such sentences are
        # dropped below, so their layout never matters.
        sizes: list[np.ndarray] = [np.empty(0)] * len(levels)
        slot_sizes: list[np.ndarray] = [np.empty(0)] * len(levels)
        for depth in reversed(range(len(levels))):
            level = levels[depth]
            slot_size = np.ones(len(level.slot_owner), dtype=np.int64)
            if depth + 1 < len(levels):
                has_child = level.slot_child >= 0
                slot_size[has_child] = sizes[depth + 1][level.slot_child[has_child]]
            slot_sizes[depth] = slot_size
            sizes[depth] = 1 + np.add.reduceat(slot_size, level.owner_first_slot)

        # Top-down: start offset of each constituent; its head is its last token.
        lengths = sizes[0]
        kept_lengths = np.where(kept, lengths, 0)
        sentence_start = _exclusive_cumsum(kept_lengths)
        total = int(kept_lengths.sum())
        terminals = np.empty(total, dtype=np.int64)
        parents = np.empty(total, dtype=np.int64)
        head_nonterminal = np.empty(total, dtype=np.int64)
        head_rule = np.empty(total, dtype=np.int64)

        node_start = np.zeros(count, dtype=np.int64)
        node_parent = np.full(count, -1, dtype=np.int64)
        for depth, level in enumerate(levels):
            head_position = node_start + sizes[depth] - 1
            keep_nodes = kept[level.node_sentence]
            flat = sentence_start[level.node_sentence] + head_position
            terminals[flat[keep_nodes]] = level.node_head[keep_nodes]
            parents[flat[keep_nodes]] = node_parent[keep_nodes]
            head_nonterminal[flat[keep_nodes]] = level.node_nonterminal[keep_nodes]
            head_rule[flat[keep_nodes]] = level.node_rule[keep_nodes]

            slot_size = slot_sizes[depth]
            before = np.cumsum(slot_size) - slot_size
            slot_start = (
                node_start[level.slot_owner]
                + before
                - before[level.owner_first_slot][level.slot_owner]
            )
            owner_head = head_position[level.slot_owner]
            body_terminal = ~level.slot_is_nonterminal & kept[level.node_sentence][level.slot_owner]
            flat = sentence_start[level.node_sentence[level.slot_owner]] + slot_start
            terminals[flat[body_terminal]] = level.slot_symbol[body_terminal]
            parents[flat[body_terminal]] = owner_head[body_terminal]
            head_nonterminal[flat[body_terminal]] = -1
            head_rule[flat[body_terminal]] = -1

            has_child = level.slot_child >= 0
            num_children = int(has_child.sum())
            node_start = np.zeros(num_children, dtype=np.int64)
            node_parent = np.zeros(num_children, dtype=np.int64)
            node_start[level.slot_child[has_child]] = slot_start[has_child]
            node_parent[level.slot_child[has_child]] = owner_head[has_child]

        offsets = np.zeros(int(kept.sum()) + 1, dtype=np.int64)
        np.cumsum(lengths[kept], out=offsets[1:])
        return SentenceBlock(
            offsets, terminals, parents, head_nonterminal, head_rule, too_long, too_short
        )


def _uniform_index(draw: np.ndarray, count: np.ndarray) -> np.ndarray:
    """floor(draw * count), clamped below count against rounding up when draw is near 1."""
    return np.minimum((draw * count).astype(np.int64), count - 1)


def rightmost_occurrence(
    sentence_ids: np.ndarray, terminals: np.ndarray, num_terminals: int
) -> np.ndarray:
    """Whether each token is the last occurrence of its terminal type in its sentence.

    Args:
        sentence_ids: `(M,)` int64, non-decreasing; tokens of a sentence in position order.
        terminals: `(M,)` int64 in `[0, num_terminals)`.

    Returns:
        `(M,)` bool.
    """
    group = sentence_ids * num_terminals + terminals
    order = np.argsort(group, kind="stable")  # ties keep position order
    ordered = group[order]
    last_of_group = np.ones(len(order), dtype=bool)
    last_of_group[:-1] = ordered[1:] != ordered[:-1]
    out = np.zeros(len(order), dtype=bool)
    out[order[last_of_group]] = True
    return out


def rightmost_sibling(
    sentence_ids: np.ndarray, positions: np.ndarray, parents: np.ndarray
) -> np.ndarray:
    """The target of each token's sibling query: the rightmost position among the tokens that
    share its parent, the token itself included (so a token with no sibling to its right, and
    the root, which has no parent, are their own targets).

    Args:
        sentence_ids: `(M,)` int64, non-decreasing; tokens of a sentence in position order.
        positions: `(M,)` int64 position of each token within its sentence.
        parents: `(M,)` int64 parent position within the sentence, -1 for the root.

    Returns:
        `(M,)` int64 position within the sentence.
    """
    out = positions.copy()
    child = np.flatnonzero(parents >= 0)
    if len(child) == 0:
        return out
    width = int(parents.max()) + 1
    _, family = np.unique(sentence_ids[child] * width + parents[child], return_inverse=True)
    rightmost = np.full(int(family.max()) + 1, -1, dtype=np.int64)
    np.maximum.at(rightmost, family, positions[child])
    out[child] = rightmost[family]
    return out


def choose_queries(
    sentence_ids: np.ndarray,
    parents: np.ndarray,
    eligible: np.ndarray,
    num_sentences: int,
    target_draw: np.ndarray,
    child_draw: np.ndarray,
) -> np.ndarray:
    """Pick one (child, parent) query per sentence: the parent uniformly among the positions
    that have an eligible child, then the child uniformly among that parent's eligible children.
    Any query relation works: `parents` may hold each token's target under another relation
    (e.g. `rightmost_sibling`), with "child" reading "query" and "parent" reading "target".

    Args:
        sentence_ids: `(M,)` int64, non-decreasing, tokens in position order within a sentence.
        parents: `(M,)` int64 parent position of each token within its sentence.
        eligible: `(M,)` bool, may the token be queried.
        num_sentences: B.
        target_draw, child_draw: `(B,)` float64 uniforms in [0, 1) of each sentence.

    Returns:
        `(B,)` int64 flat index of each sentence's queried child, -1 where no token is eligible.
    """
    candidates = np.flatnonzero(eligible)
    width = int(parents.max()) + 2 if len(parents) else 1
    target_key = sentence_ids[candidates] * width + parents[candidates]
    order = np.argsort(target_key, kind="stable")
    candidates, target_key = candidates[order], target_key[order]
    new_target = np.ones(len(candidates), dtype=bool)
    new_target[1:] = target_key[1:] != target_key[:-1]
    target_first = np.flatnonzero(new_target)  # first candidate of each target
    target_size = np.diff(np.append(target_first, len(candidates)))
    target_sentence = sentence_ids[candidates[target_first]]
    targets_per_sentence = np.bincount(target_sentence, minlength=num_sentences)
    first_target = _exclusive_cumsum(targets_per_sentence)

    chosen = np.full(num_sentences, -1, dtype=np.int64)
    has = targets_per_sentence > 0
    target = first_target[has] + _uniform_index(target_draw[has], targets_per_sentence[has])
    child = target_first[target] + _uniform_index(child_draw[has], target_size[target])
    chosen[has] = candidates[child]
    return chosen
