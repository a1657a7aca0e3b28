"""Associative treecall (ATR, docs/study.md): recall the parent of a token in a sentence of a
random grammar.

Document (n terminals, 3 <= n <= max_length):

    BOS t1 ... tn EOS child parent EOS        (n + 5 tokens)

Token ids: terminals `3 .. 3+T-1`, then three reserved query-type ids `3+T .. 3+T+2` (unused by
parent queries), vocabulary `T + 6`. The grammar (see `grammar.py`) is drawn once from the
task's `seed`; sentences are drawn from it (see `tree_sampler.py`), each from a start
nonterminal drawn uniformly among all nonterminals anew for every sentence (as the study's
generator does), and a sentence is redrawn (start symbol included) when it is shorter than 3,
longer than `max_length`, or has no eligible query.

Query (`query="parent"`, the default): an eligible child is a token that has a parent and is
the rightmost occurrence of its terminal in the sentence. The parent position (the target) is
drawn uniformly among positions with an eligible child, then the child uniformly among its
eligible children. Named positions: `key` = the child's position, `value` = its parent's
position (always to the right of `key`), `divider = n + 1`, `query = n + 2`, `answer = n + 3`.
Corruptions at `key` and `value` draw from the terminal ids.

Sibling queries (`query="sibling"`, the study's "sibling" experiments, its multihop language
with parent and child queries off): the answer to a query token is the rightmost of the tokens
that share its parent, the query itself included, so a token with no sibling to its right
(and the root) answers itself. A (query, target) pair is eligible when both are the rightmost
occurrence of their terminal; the target is drawn uniformly among eligible targets, then the
query among its eligible queries. The document has the same layout (only one query type is
asked, so no query-type token, as in the study); `key` is the query's position and `value` the
target's, at or to the right of `key` (equal when the query answers itself). Sibling queries
take no holdout. The option appears in `config()` only when set, so the documents and cache
keys of parent queries are those of generator version 2.

Study draws (`draw="study"` or `"study_after_easy"`, see `study_draw.py`): the grammar and the
documents are drawn exactly as the study's code draws them, from NumPy's legacy generator
seeded with `seed` (42 in the study), so its settings give its grammar and its documents. One
language is one stream: the grammar, 100,032 training documents, 1,024 evaluation documents.
`"study_after_easy"` continues the stream after a whole language of the same options with
`max_rhs_len=5`, as the study's script drew its (10, 20) language after its (5, 20) one. Splits:
train is the study's training documents, dev its evaluation documents 1..320 (those it
evaluated on), test its evaluation documents 321..1,024; the sampling seed must be 0 (one
stream) and a split holds no more documents than that. Not offered with holdout or sibling
queries.

Held-out pairs (`holdout = h > 0`): a `PairHoldout` over (parent terminal, child terminal)
pairs, salted with the grammar seed, marks a fraction h of the T*T pairs (exactly
round(h*T*T) of them when T*T <= 2**22). Train and dev query only pairs that are not held out;
test queries only held-out pairs. Sentences themselves are not filtered: held-out pairs may
occur unqueried in train and dev sentences.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import numpy as np
import torch

from mecheval.checks import check_int
from mecheval.tasks.base import SPLITS, Task, check_fraction, check_split
from mecheval.tasks.batch import Batch
from mecheval.tasks.grammar import Grammar, GrammarOptions, sample_grammar
from mecheval.tasks.holdout import PairHoldout
from mecheval.tasks.study_draw import (
    STUDY_EVAL_SIZE,
    STUDY_TRAIN_SIZE,
    StudyLanguage,
    study_language,
)
from mecheval.tasks.tree_sampler import (
    TreeSampler,
    choose_queries,
    rightmost_occurrence,
    rightmost_sibling,
)

BLOCK_DRAWS = 1024
"""Sentences drawn per block (the unit of the seeded stream); rejected ones are dropped."""
MIN_LENGTH = 3
MAX_DRAWS_PER_DOCUMENT = 100
"""Sampling gives up once it has drawn this many sentences per requested document (and at
least 16 blocks) without producing enough eligible documents: acceptance below 1%."""
MIN_BLOCKS_BEFORE_GIVING_UP = 16
AUTO_TERMINAL_FACTOR = 20.0
"""`terminal_factor="auto"` means this factor when `num_terminals > 20`, else None."""
_GRAMMAR_STREAM = 0
QUERY_RELATIONS = ("parent", "sibling")
DRAWS = ("mecheval", "study", "study_after_easy")
STUDY_DEV_SIZE = 320
"""With a study draw, dev holds the study's evaluation documents 1..320 (those it evaluated on)
and test the rest of them (321..1,024)."""


@dataclass(frozen=True)
class TreeAnnotations:
    """The trees behind sampled ATR documents, aligned with `Batch.tokens` columns.

    Attributes:
        parents: `LongTensor (n, L)`, column of each sentence token's parent, -1 for the root
            and for every column outside the sentence.
        head_nonterminal: `LongTensor (n, L)`, the nonterminal whose head the token is, -1 for
            terminals written in a rule body and outside the sentence.
        head_rule: `LongTensor (n, L)`, the rule index (into the grammar's flat rule arrays)
            that nonterminal expanded with, or -1.
    """

    parents: torch.Tensor
    head_nonterminal: torch.Tensor
    head_rule: torch.Tensor


@dataclass(frozen=True, kw_only=True)
class AssociativeTreecall(Task):
    """Associative treecall; see the module docstring.

    Args:
        max_rhs_len: rule bodies have length `1..max_rhs_len - 1` (5 or 10 in the study).
        num_terminals: T (20 or 8192 in the study).
        terminal_factor: weight r of the terminal slot in body draws, None for uniform draws
            over nonterminals and terminals, or "auto" (the default): 20 when
            num_terminals > 20, else None. Stored resolved.
        num_nonterminals: nonterminals of the grammar.
        max_depth: depth scores are uniform in `1..max_depth`.
        max_rules: rules per nonterminal are uniform in `1..max_rules`.
        holdout: fraction of (parent, child) terminal pairs queried only in test.
        seed: the grammar's seed.
        max_length: longest sentence kept, in terminals.
        query: "parent" (the answer is the query token's parent) or "sibling" (the answer is
            the rightmost token sharing the query's parent); see the module docstring.
        draw: "mecheval" (grammar and documents from seeded PCG64 streams), "study" (both
            drawn as the study's code draws them from NumPy's legacy generator seeded with
            `seed`, see `study_draw.py`) or "study_after_easy" (as "study", the stream
            continued after a whole language of the same options with max_rhs_len 5: the
            study's (10, 20) language); see the module docstring.
    """

    max_rhs_len: int
    num_terminals: int
    terminal_factor: float | None | Literal["auto"] = "auto"
    num_nonterminals: int = 40
    max_depth: int = 10
    max_rules: int = 5
    holdout: float = 0.0
    seed: int = 0
    max_length: int = 1024
    query: Literal["parent", "sibling"] = "parent"
    draw: Literal["mecheval", "study", "study_after_easy"] = "mecheval"
    name = "atr"
    generator_version = 2
    """2: each sentence draws its own start nonterminal (1: one start symbol per grammar)."""
    _pairs_held_out: PairHoldout | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._set_option("max_rhs_len", check_int("max_rhs_len", self.max_rhs_len, 2))
        self._set_option("num_terminals", check_int("num_terminals", self.num_terminals, 2))
        self._set_option(
            "num_nonterminals", check_int("num_nonterminals", self.num_nonterminals, 1)
        )
        self._set_option("max_depth", check_int("max_depth", self.max_depth, 1))
        self._set_option("max_rules", check_int("max_rules", self.max_rules, 1))
        self._set_option("seed", check_int("seed", self.seed, 0))
        self._set_option("max_length", check_int("max_length", self.max_length, MIN_LENGTH))
        self._set_option("terminal_factor", self._resolve_terminal_factor())
        self._set_option("holdout", check_fraction("holdout", self.holdout))
        if self.query not in QUERY_RELATIONS:
            raise ValueError(f"option 'query' must be one of {QUERY_RELATIONS}, got {self.query!r}")
        if self.query == "sibling" and self.holdout > 0:
            raise ValueError("option 'holdout' is not offered with query='sibling'")
        self._check_draw()
        held_out = None
        if self.holdout > 0:
            held_out = PairHoldout(self.num_terminals, self.num_terminals, self.holdout, self.seed)
            if held_out.threshold == 0:
                raise ValueError(f"option 'holdout'={self.holdout} holds out no pair at all")
        self._set_option("_pairs_held_out", held_out)

    def _check_draw(self) -> None:
        if self.draw not in DRAWS:
            raise ValueError(f"option 'draw' must be one of {DRAWS}, got {self.draw!r}")
        if self.draw == "mecheval":
            return
        if self.holdout > 0:
            raise ValueError(
                f"option draw={self.draw!r} does not take holdout > 0 (the study's held-out "
                "pairs are not offered)"
            )
        if self.query != "parent":
            raise ValueError(f"option draw={self.draw!r} offers only query='parent'")

    def _resolve_terminal_factor(self) -> float | None:
        factor = self.terminal_factor
        if factor == "auto":
            return AUTO_TERMINAL_FACTOR if self.num_terminals > 20 else None
        if factor is None:
            return None
        if isinstance(factor, bool) or not isinstance(factor, (int, float, np.number)):
            raise TypeError(
                f"option 'terminal_factor' must be a number, None or 'auto', got {factor!r}"
            )
        if not float(factor) > 0:
            raise ValueError(f"option 'terminal_factor' must be > 0, got {factor}")
        return float(factor)

    def _default_of(self, option: Any) -> Any:
        if option.name == "terminal_factor":
            return AUTO_TERMINAL_FACTOR if self.num_terminals > 20 else None
        return option.default

    def config(self) -> dict[str, Any]:
        """The options, `query` only when it is not "parent" and `draw` only when it is not
        "mecheval" (so other tasks keep the data identity, hence the documents and cache keys,
        they had before these options)."""
        config = super().config()
        if config["query"] == "parent":
            del config["query"]
        if config["draw"] == "mecheval":
            del config["draw"]
        return config

    @property
    def pairs_held_out(self) -> PairHoldout | None:
        """The held-out (parent terminal, child terminal) pairs, or None when `holdout == 0`."""
        return self._pairs_held_out

    @cached_property
    def grammar(self) -> Grammar:
        """The task's grammar, drawn from `seed` (independent of the other options' digest)."""
        if self.draw != "mecheval":
            return self._study_language.grammar
        rng = np.random.Generator(
            np.random.PCG64(np.random.SeedSequence([self.seed, _GRAMMAR_STREAM]))
        )
        return sample_grammar(rng, self._grammar_options)

    @property
    def _grammar_options(self) -> GrammarOptions:
        return GrammarOptions(*(getattr(self, name) for name in GrammarOptions._fields))

    @cached_property
    def _study_language(self) -> StudyLanguage:
        """The study's language of these options (drawn as its documents are asked for)."""
        return study_language(
            self.seed,
            after_easy=self.draw == "study_after_easy",
            max_length=self.max_length,
            options=self._grammar_options,
        )

    @cached_property
    def _sampler(self) -> TreeSampler:
        return TreeSampler(self.grammar, self.max_length, MIN_LENGTH)

    # ---- vocabulary ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.num_terminals + 6

    @property
    def max_document_length(self) -> int:
        """BOS, up to max_length terminals, EOS, child, parent, EOS."""
        return self.max_length + 5

    @property
    def first_terminal(self) -> int:
        return 3

    def token_name(self, token: int) -> str:
        if self.first_terminal <= token < self.first_terminal + self.num_terminals:
            return f"t{token - self.first_terminal}"
        if self.first_terminal + self.num_terminals <= token < self.vocab_size:
            return f"q{token - self.first_terminal - self.num_terminals}"
        raise ValueError(f"token id {token} is not in the ATR vocabulary (size {self.vocab_size})")

    def token_range(self, at: str) -> tuple[int, int]:
        if at not in ("key", "value"):
            raise ValueError(f"at must be 'key' or 'value', got {at!r}")
        return self.first_terminal, self.first_terminal + self.num_terminals

    def replacement_range(self, at: str) -> tuple[int, int]:
        """The terminal ids at both positions (the study draws any terminal but the original)."""
        return self.token_range(at)

    # ---- generation ----------------------------------------------------------------------

    def _generate(self, n: int, seed: int, split: str) -> Batch:
        return self._generate_with_trees(n, seed, split)[0]

    def sample_with_trees(
        self, n: int, seed: int, split: str = "train"
    ) -> tuple[Batch, TreeAnnotations]:
        """`sample(n, seed, split)` together with the trees the sampler built (for checks)."""
        check_int("n", n, 1)
        check_int("seed", seed, 0)
        return self._generate_with_trees(n, seed, check_split(split))

    def _generate_with_trees(self, n: int, seed: int, split: str) -> tuple[Batch, TreeAnnotations]:
        if self.draw != "mecheval":
            return self._study_documents(n, seed, split)
        stream = SPLITS.index(split)
        parts: list[dict[str, np.ndarray]] = []
        accepted = draws = block = 0
        rejected = np.zeros(3, dtype=np.int64)  # too short, too long, no eligible query
        limit = max(MIN_BLOCKS_BEFORE_GIVING_UP * BLOCK_DRAWS, MAX_DRAWS_PER_DOCUMENT * n)
        while accepted < n:
            part, block_rejected = self._sample_block(self.task_rng(seed, stream, block), split)
            parts.append(part)
            accepted += len(part["lengths"])
            draws += BLOCK_DRAWS
            rejected += block_rejected
            block += 1
            if accepted < n and draws >= limit:
                too_short, too_long, no_query = rejected.tolist()
                raise RuntimeError(
                    f"{self.label()} cannot produce enough eligible {split!r} documents: "
                    f"{accepted} of {draws} drawn sentences accepted, {n} requested "
                    f"({too_short} shorter than {MIN_LENGTH} tokens, {too_long} longer than "
                    f"max_length={self.max_length}, {no_query} without an eligible query)"
                )
        return self._assemble(parts, n)

    def _study_documents(self, n: int, seed: int, split: str) -> tuple[Batch, TreeAnnotations]:
        """The study's documents: train its training documents, dev its evaluation documents
        1..320, test its evaluation documents 321..1,024 (one stream: seed must be 0)."""
        if seed != 0:
            raise ValueError(
                f"{self.label()} has the study's one document stream: seed must be 0, got {seed}"
            )
        first, available = {
            "train": (0, STUDY_TRAIN_SIZE),
            "dev": (STUDY_TRAIN_SIZE, STUDY_DEV_SIZE),
            "test": (STUDY_TRAIN_SIZE + STUDY_DEV_SIZE, STUDY_EVAL_SIZE - STUDY_DEV_SIZE),
        }[split]
        if n > available:
            raise ValueError(
                f"{self.label()} has {available} {split!r} documents (the study's), {n} asked for"
            )
        part = self._study_language.documents(first, first + n)
        return self._assemble([part], n)

    def _sample_block(
        self, rng: np.random.Generator, split: str
    ) -> tuple[dict[str, np.ndarray], tuple[int, int, int]]:
        """Draw `BLOCK_DRAWS` sentences; keep those with a query.

        Returns:
            a dict of flat arrays of the kept sentences (`lengths`, `terminals`, `parents`,
            `head_nonterminal`, `head_rule`, `child` and `parent` positions) and the counts of
            (too short, too long, no eligible query).
        """
        sentences = self._sampler.sample(rng, BLOCK_DRAWS)
        num_sentences = len(sentences.lengths)
        sentence_ids = sentences.sentence_ids
        eligible = rightmost_occurrence(sentence_ids, sentences.terminals, self.num_terminals)
        if self.query == "sibling":
            targets = rightmost_sibling(sentence_ids, sentences.positions, sentences.parents)
            eligible &= eligible[sentences.offsets[sentence_ids] + targets]
        else:
            targets = sentences.parents
            eligible &= targets >= 0
        if self.pairs_held_out is not None:
            parent_flat = sentences.offsets[sentence_ids] + np.maximum(sentences.parents, 0)
            held = self.pairs_held_out.is_held_out(
                sentences.terminals[parent_flat], sentences.terminals
            )
            eligible &= held if split == "test" else ~held
        target_draw, child_draw = rng.random(num_sentences), rng.random(num_sentences)
        child = choose_queries(
            sentence_ids, targets, eligible, num_sentences, target_draw, child_draw
        )
        keep = child >= 0
        keep_tokens = keep[sentence_ids]
        child_position = child[keep] - sentences.offsets[:-1][keep]
        part = {
            "lengths": sentences.lengths[keep],
            "terminals": sentences.terminals[keep_tokens],
            "parents": sentences.parents[keep_tokens],
            "head_nonterminal": sentences.head_nonterminal[keep_tokens],
            "head_rule": sentences.head_rule[keep_tokens],
            "child": child_position,
            "parent": targets[child[keep]],
        }
        rejected = (sentences.num_too_short, sentences.num_too_long, int((~keep).sum()))
        return part, rejected

    def _assemble(
        self, parts: list[dict[str, np.ndarray]], n: int
    ) -> tuple[Batch, TreeAnnotations]:
        """Lay the first `n` kept sentences out as documents (see the module docstring)."""
        flat = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        lengths = flat["lengths"][:n]
        num_tokens = int(lengths.sum())
        width = int(lengths.max()) + 5
        row = np.repeat(np.arange(n), lengths)
        column = 1 + np.arange(num_tokens) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        documents = np.arange(n)

        tokens = np.zeros((n, width), dtype=np.int64)
        tokens[:, 0] = self.BOS
        sentence_tokens = self.first_terminal + flat["terminals"][:num_tokens]
        tokens[row, column] = sentence_tokens
        key = 1 + flat["child"][:n]
        value = 1 + flat["parent"][:n]
        divider = lengths + 1
        tokens[documents, divider] = self.EOS
        tokens[documents, divider + 1] = tokens[documents, key]
        tokens[documents, divider + 2] = tokens[documents, value]
        tokens[documents, divider + 3] = self.EOS

        def columns_of(values: np.ndarray, offset: int) -> torch.Tensor:
            out = np.full((n, width), -1, dtype=np.int64)
            out[row, column] = np.where(values >= 0, values + offset, -1)
            return torch.from_numpy(out)

        batch = Batch(
            tokens=torch.from_numpy(tokens),
            answers=torch.from_numpy(tokens[documents, divider + 2].copy()),
            positions={
                name: torch.from_numpy(np.ascontiguousarray(values))
                for name, values in [
                    ("key", key),
                    ("value", value),
                    ("divider", divider),
                    ("query", divider + 1),
                    ("answer", divider + 2),
                ]
            },
            lengths=torch.from_numpy(lengths + 5),
        )
        trees = TreeAnnotations(
            parents=columns_of(flat["parents"][:num_tokens], 1),
            head_nonterminal=columns_of(flat["head_nonterminal"][:num_tokens], 0),
            head_rule=columns_of(flat["head_rule"][:num_tokens], 0),
        )
        return batch, trees
