"""ATR grammars and documents drawn exactly as the study's own generator draws them
(`draw="study"` of `AssociativeTreecall`; docs/deviations.md).

The study draws everything from NumPy's legacy global generator, seeded once with the seed
(42): a `numpy.random.RandomState` here, called in the same order with the same arguments, so
the same seed gives the same grammar and the same documents. One language is the grammar, then
its 100,032 training documents, then its 1,024 evaluation documents, all from one stream.

Grammar (N nonterminals, T terminals), in draw order:

1. each nonterminal's depth score, `randint(1, max_depth + 1)`;
2. per nonterminal: its rule count `randint(1, max_rules + 1)`; per rule the body length
   `randint(1, max_rhs_len)`, then the body's symbols in one `choice` of that size over the
   allowed nonterminals (ascending) followed by either all T terminals (uniform) or, with a
   terminal factor r, one terminal slot (weights 1, ..., 1, r, normalised);
3. with a terminal factor, every terminal slot in order (nonterminal, rule, position) becomes
   `choice(T)`;
4. per nonterminal, its rule probabilities `dirichlet(ones(rules))`;
5. per nonterminal, its head distribution `dirichlet(ones(T))`.

A document: a sentence from a start nonterminal `choice(N, p=uniform)`, expanded depth-first,
leftmost first; each expansion draws its rule, then its head (`choice` with probabilities). A
sentence whose expansion still has symbols left once it holds `max_length` terminals is
abandoned there; it, a complete one shorter than 3 terminals, or one without an eligible query
is dropped with its draws spent, and a new one is drawn. (Versions of the study's generator
before 11 May 2025 completed an over-long sentence before dropping it, spending more draws;
none of the study's 20-terminal languages nor its (5, 8192) one has a sentence that long, so
both versions give them the same documents.)

The query: one `choice` over the single query type, the parent (target) by `choice` over the
positions that have an eligible child listed in the iteration order of a Python set
built from them in ascending order (the study's `list(set(...))`), then the child by `choice`
over that parent's eligible children in position order. Eligible children are those with a
parent that are the rightmost occurrence of their terminal.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right

import numpy as np

from mecheval.tasks.grammar import Grammar, GrammarOptions

STUDY_TRAIN_SIZE = 100_032
"""Training documents of a study language (drawn first)."""
STUDY_EVAL_SIZE = 1_024
"""Evaluation documents of a study language (drawn after the training documents)."""
MIN_LENGTH = 3
TOKEN_COLUMNS = ("terminals", "parents", "head_nonterminal", "head_rule")
TERMINAL_SLOT = -1
"""Body code of a terminal slot not yet filled (terminal t has code -2 - t)."""


def _legacy_cdf(probs: np.ndarray) -> list[float]:
    """The table `RandomState.choice(p=probs)` searches: cumulative sums over their last."""
    cdf = np.asarray(probs, dtype=np.float64).cumsum()
    cdf /= cdf[-1]
    return cdf.tolist()


def _symbol_code(pick: int, allowed: list[int], terminal_factor: float | None) -> int:
    """A body symbol as a code: the nonterminal (>= 0), terminal t as `-2 - t`, or
    `TERMINAL_SLOT` for the terminal slot of a weighted draw (filled in later)."""
    if pick < len(allowed):
        return allowed[pick]
    return TERMINAL_SLOT if terminal_factor is not None else -2 - (pick - len(allowed))


def draw_study_grammar(rs: np.random.RandomState, options: GrammarOptions) -> Grammar:
    """Draw a grammar from `rs` in the study's order (module docstring, steps 1-5)."""
    num_nonterminals, num_terminals, max_rhs_len, terminal_factor, max_depth, max_rules = options
    depth_scores = np.array([rs.randint(1, max_depth + 1) for _ in range(num_nonterminals)])
    bodies: list[list[list[int]]] = []  # per nonterminal, per rule: symbol codes
    for owner in range(num_nonterminals):
        allowed = np.flatnonzero(depth_scores > depth_scores[owner]).tolist()
        num_rules = rs.randint(1, max_rules + 1)
        if terminal_factor is not None:
            weights = np.ones(len(allowed) + 1)
            weights[-1] = terminal_factor
            weights = weights / np.sum(weights)
        rules = []
        for _ in range(num_rules):
            length = rs.randint(1, max_rhs_len)
            if terminal_factor is not None:
                picks = rs.choice(len(allowed) + 1, size=length, replace=True, p=weights)
            else:
                picks = rs.choice(len(allowed) + num_terminals, size=length, replace=True)
            rules.append([_symbol_code(pick, allowed, terminal_factor) for pick in picks.tolist()])
        bodies.append(rules)
    if terminal_factor is not None:
        for rules in bodies:
            for body in rules:
                for i, code in enumerate(body):
                    if code == TERMINAL_SLOT:
                        body[i] = -2 - int(rs.randint(0, num_terminals))
    rule_probs = [rs.dirichlet(np.ones(len(rules))) for rules in bodies]
    head_probs = np.stack([rs.dirichlet(np.ones(num_terminals)) for _ in bodies])
    return _grammar_from_bodies(num_terminals, depth_scores, bodies, rule_probs, head_probs)


def _grammar_from_bodies(
    num_terminals: int,
    depth_scores: np.ndarray,
    bodies: list[list[list[int]]],
    rule_probs: list[np.ndarray],
    head_probs: np.ndarray,
) -> Grammar:
    """The flat-array `Grammar` of per-nonterminal rule bodies (codes as `_symbol_code`'s)."""
    rule_owner = [owner for owner, rules in enumerate(bodies) for _ in rules]
    flat_bodies = [body for rules in bodies for body in rules]
    codes = np.array([code for body in flat_bodies for code in body], dtype=np.int64)
    owners = np.asarray(rule_owner, dtype=np.int64)
    return Grammar(
        num_terminals=num_terminals,
        depth_scores=depth_scores.astype(np.int64),
        rule_owner=owners,
        rule_first=np.searchsorted(owners, np.arange(len(bodies) + 1)).astype(np.int64),
        rule_probs=np.concatenate(rule_probs).astype(np.float64),
        body_first=np.concatenate([[0], np.cumsum([len(b) for b in flat_bodies])]).astype(np.int64),
        body_is_nonterminal=codes >= 0,
        body_symbol=np.where(codes >= 0, codes, -2 - codes),
        head_probs=head_probs,
    )


def _body(grammar: Grammar, rule: int) -> list[tuple[bool, int]]:
    """A rule's body as `(is_nonterminal, symbol)` pairs."""
    span = slice(grammar.body_first[rule], grammar.body_first[rule + 1])
    return list(
        zip(
            grammar.body_is_nonterminal[span].tolist(),
            grammar.body_symbol[span].tolist(),
            strict=True,
        )
    )


class StudyLanguage:
    """One study language: its grammar and its documents, drawn on demand from `rs` (which it
    then owns: every later draw from `rs` continues the study's stream).

    Args:
        rs: the generator, positioned where the study's script drew this language's grammar.
        max_length: longest sentence kept, in terminals (the study's 1024).
        options: the grammar's.
    """

    def __init__(self, rs: np.random.RandomState, max_length: int, options: GrammarOptions) -> None:
        self.grammar = draw_study_grammar(rs, options)
        self.max_length = max_length
        self._rs = rs
        # The documents drawn so far, flat (int32): token columns over all sentences, the
        # sentences' offsets into them, and each document's queried child and parent.
        self._tokens = {name: array("i") for name in TOKEN_COLUMNS}
        self._offsets = array("q", [0])
        self._query = {"child": array("i"), "parent": array("i")}
        grammar = self.grammar
        self._start_cdf = _legacy_cdf(np.ones(grammar.num_nonterminals) / grammar.num_nonterminals)
        self._rule_cdf = [
            _legacy_cdf(grammar.rule_probs[grammar.rule_first[x] : grammar.rule_first[x + 1]])
            for x in range(grammar.num_nonterminals)
        ]
        self._head_cdf = [_legacy_cdf(row) for row in grammar.head_probs]
        self._bodies = [_body(grammar, rule) for rule in range(len(grammar.rule_probs))]
        self._rule_first = grammar.rule_first.tolist()

    def documents(self, start: int, stop: int) -> dict[str, np.ndarray]:
        """Documents `start..stop - 1` of the language (training documents first), drawn as far
        as needed, as flat int64 arrays: `lengths` per document, the token columns
        `TOKEN_COLUMNS` (parents as positions within the sentence, -1 for the root) over their
        sentences, and the queried `child` and `parent` positions per document."""
        if not 0 <= start <= stop <= STUDY_TRAIN_SIZE + STUDY_EVAL_SIZE:
            raise ValueError(
                f"a study language has documents 0..{STUDY_TRAIN_SIZE + STUDY_EVAL_SIZE - 1}, "
                f"{start}..{stop - 1} asked for"
            )
        while len(self._query["child"]) < stop:
            sentence, child, parent = self._draw_document()
            for name, values in zip(TOKEN_COLUMNS, sentence, strict=True):
                self._tokens[name].extend(values)
            self._offsets.append(self._offsets[-1] + len(sentence[0]))
            self._query["child"].append(child)
            self._query["parent"].append(parent)
        offsets = np.frombuffer(self._offsets, dtype=np.int64)[start : stop + 1]
        tokens = slice(int(offsets[0]), int(offsets[-1]))
        return {
            "lengths": np.diff(offsets),
            **{
                name: np.frombuffer(column, dtype=np.int32)[tokens].astype(np.int64)
                for name, column in self._tokens.items()
            },
            **{
                name: np.frombuffer(column, dtype=np.int32)[start:stop].astype(np.int64)
                for name, column in self._query.items()
            },
        }

    def _draw_document(self) -> tuple[tuple[list[int], ...], int, int]:
        """One accepted document: its sentence (as `_draw_sentence`), child and parent."""
        rs = self._rs
        while True:
            sentence = self._draw_sentence()
            if sentence is None or len(sentence[0]) < MIN_LENGTH:
                continue
            terminals, parents = sentence[0], sentence[1]
            last = {terminal: position for position, terminal in enumerate(terminals)}
            eligible = [q for q, t in enumerate(terminals) if parents[q] >= 0 and last[t] == q]
            if eligible:
                break
        rs.randint(0, 1)  # the study's choice among its one query type
        by_target = sorted(eligible, key=lambda q: (parents[q], q))
        targets = list(set([parents[q] for q in by_target]))
        target = targets[rs.randint(0, len(targets))]
        children = [q for q in by_target if parents[q] == target]
        child = children[rs.randint(0, len(children))]
        return sentence, child, target

    def _draw_sentence(self) -> tuple[list[int], list[int], list[int], list[int]] | None:
        """One sentence, depth-first as the study expands it: `(terminals, parents,
        head_nonterminal, head_rule)`, parents as positions (-1 for the root); None when it
        passes `max_length` (its expansion stops at the first token beyond)."""
        rs = self._rs
        terminals: list[int] = []
        parent_node: list[int] = []  # per token: the head node of its parent, -1 for the root
        head_nonterminal: list[int] = []
        head_rule: list[int] = []
        node_position: list[int] = []  # per expanded nonterminal: where its head token lies
        # Stack entries: (kind, symbol, parent node, own node, rule); kind 0 = nonterminal to
        # expand, 1 = body terminal, 2 = the head of an expanded nonterminal.
        stack = [(0, bisect_right(self._start_cdf, rs.random_sample()), -1, -1, -1)]
        while stack:
            if len(terminals) >= self.max_length:
                return None  # the study stops a sentence once it reaches max_length tokens
            kind, symbol, parent, node, rule = stack.pop()
            if kind == 0:
                local = bisect_right(self._rule_cdf[symbol], rs.random_sample())
                rule = self._rule_first[symbol] + local
                head = bisect_right(self._head_cdf[symbol], rs.random_sample())
                node = len(node_position)
                node_position.append(-1)
                stack.append((2, head, parent, node, rule))
                for is_nonterminal, body_symbol in reversed(self._bodies[rule]):
                    stack.append((0 if is_nonterminal else 1, body_symbol, node, -1, -1))
                continue
            terminals.append(symbol)
            parent_node.append(parent)
            if kind == 2:
                node_position[node] = len(terminals) - 1
                head_nonterminal.append(int(self.grammar.rule_owner[rule]))
                head_rule.append(rule)
            else:
                head_nonterminal.append(-1)
                head_rule.append(-1)
        parents = [node_position[p] if p >= 0 else -1 for p in parent_node]
        return terminals, parents, head_nonterminal, head_rule


def study_language(
    seed: int, *, after_easy: bool, max_length: int, options: GrammarOptions
) -> StudyLanguage:
    """The study's language of these settings: `RandomState(seed)`, and with `after_easy` the
    stream continued after a whole language of the same settings with `max_rhs_len=5` (its
    grammar and all its 101,056 documents), as the study's first language script drew its
    (10, 20) language after its (5, 20) one."""
    rs = np.random.RandomState(seed)
    if after_easy:
        easy = StudyLanguage(rs, max_length, options._replace(max_rhs_len=5))
        easy.documents(0, STUDY_TRAIN_SIZE + STUDY_EVAL_SIZE)
    return StudyLanguage(rs, max_length, options)
