"""Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"), laid out as zoology's
generator lays it out, its settings as options.

Document (P = num_kv_pairs, L = input_seq_len, V = vocab_size, one pass):

    k1 v1 k2 v2 ... kP vP | r r k_a r r r k_b r ...         (L tokens, no BOS or EOS)

Keys are drawn without replacement from ids 1 .. V/2 - 1, values from V/2 .. V - 1. After the
2P tokens of pairs (num_passes times over: the JRT layout), the L - 2P positions hold the
queries: each of the P keys once, the one queried i-th at even offset 2 g_i, where the gaps
g_1..g_P are drawn without replacement from 0 .. (L - 2P)/2 - 1 with probability proportional to
power_a * g^(power_a - 1) for g = 1, 2, ... (a power law: most queries close to the pairs).
Every other position holds 0, replaced by a uniform id of 0 .. V - 1 when random_non_queries.
The answer to a query is its key's value, predicted at the query's position; nothing else
carries loss.

Rows: one per query, in document order. Roles: `key` (the queried key in the last pass of
pairs), `value` (its value: key + 1) and `query`. Corruptions: `key` draws another key id,
`value` another value id (each from its own kind's ids).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from mecheval.checks import check_int
from mecheval.tasks.associative_recall import sample_distinct_rows
from mecheval.tasks.base import Task
from mecheval.tasks.batch import Batch, concat_batches

BLOCK_SIZE = 4096


def power_law(space: int, power_a: float) -> np.ndarray:
    """(space,) the probability of each gap 0 .. space - 1: proportional to
    power_a * g^(power_a - 1) for g = 1 .. space."""
    weights = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return weights / weights.sum()


def weighted_without_replacement(
    rng: np.random.Generator, rows: int, size: int, p: np.ndarray
) -> np.ndarray:
    """(rows, size): each row `size` distinct indices drawn one after another, each with
    probability proportional to `p` among those not drawn yet (Efraimidis and Spirakis: the
    `size` largest of u^(1/p), in order)."""
    keys = np.log(rng.random((rows, len(p)))) / p
    order = np.argsort(-keys, axis=1, kind="stable")
    return order[:, :size]


@dataclass(frozen=True)
class MultiQueryAR(Task):
    """MQAR; see the module docstring.

    Args:
        vocab_size: V, ids 0 .. V - 1 (8,192 in zoology's experiments).
        input_seq_len: L, tokens per document (even; 64 to 512 in zoology's Figure 2).
        num_kv_pairs: P, pairs per document, each queried once (4 to 64 there).
        power_a: the power law of the query gaps (0.01).
        num_passes: times the pairs are repeated before the queries (1; JRT uses more).
        random_non_queries: fill the non-query positions after the pairs with random ids.
    """

    vocab_size: int = 8192
    input_seq_len: int = 64
    num_kv_pairs: int = 8
    power_a: float = 0.01
    num_passes: int = 1
    random_non_queries: bool = True
    name: ClassVar[str] = "mqar"
    roles: ClassVar[tuple[str, ...]] = ("key", "value", "query")
    special_tokens: ClassVar[bool] = False

    def __post_init__(self) -> None:
        self._set_option("vocab_size", check_int("vocab_size", self.vocab_size, 8))
        self._set_option("input_seq_len", check_int("input_seq_len", self.input_seq_len, 2))
        self._set_option("num_kv_pairs", check_int("num_kv_pairs", self.num_kv_pairs, 1))
        self._set_option("num_passes", check_int("num_passes", self.num_passes, 1))
        if self.input_seq_len % 2:
            raise ValueError(f"option 'input_seq_len' must be even, got {self.input_seq_len}")
        if self.vocab_size <= self.input_seq_len:
            raise ValueError(
                f"option 'vocab_size' ({self.vocab_size}) must exceed input_seq_len "
                f"({self.input_seq_len}), as zoology requires"
            )
        if self.num_kv_pairs > self.vocab_size // 2 - 1:
            raise ValueError(
                f"option 'num_kv_pairs' ({self.num_kv_pairs}) exceeds the "
                f"{self.vocab_size // 2 - 1} key ids"
            )
        needed = 2 * self.num_kv_pairs * (self.num_passes + 1)
        if needed > self.input_seq_len:
            raise ValueError(
                f"{self.num_kv_pairs} pairs over {self.num_passes} pass(es) and their queries need "
                f"input_seq_len >= {needed}, got {self.input_seq_len}"
            )
        if isinstance(self.power_a, bool) or not isinstance(self.power_a, (int, float)):
            raise TypeError(f"option 'power_a' must be a float, got {self.power_a!r}")
        if not self.power_a > 0:
            raise ValueError(f"option 'power_a' must be > 0, got {self.power_a}")
        self._set_option("power_a", float(self.power_a))
        if not isinstance(self.random_non_queries, bool):
            raise TypeError("option 'random_non_queries' must be true or false")

    @property
    def max_document_length(self) -> int:
        return self.input_seq_len

    @property
    def first_value(self) -> int:
        return self.vocab_size // 2

    def token_name(self, token: int) -> str:
        if not 0 <= token < self.vocab_size:
            raise ValueError(
                f"token id {token} is not in the MQAR vocabulary (size {self.vocab_size})"
            )
        return f"k{token}" if 0 < token < self.first_value else ("0" if token == 0 else f"v{token}")

    def token_range(self, role: str) -> tuple[int, int] | None:
        return {"key": (1, self.first_value), "value": (self.first_value, self.vocab_size)}.get(
            role
        )

    def replacement_range(self, corruption: str) -> tuple[int, int]:
        return self.token_range(self.corruption(corruption).role)

    def _generate(self, n: int, seed: int, split: str) -> Batch:
        stream = self.splits.index(split)
        blocks = [
            self._block(self.task_rng(seed, stream, block)) for block in range(-(-n // BLOCK_SIZE))
        ]
        batch = concat_batches(blocks) if len(blocks) > 1 else blocks[0]
        return batch[: n * self.num_kv_pairs]

    def _block(self, rng: np.random.Generator) -> Batch:
        rows, pairs, length = BLOCK_SIZE, self.num_kv_pairs, self.input_seq_len
        keys = 1 + sample_distinct_rows(rng, rows, pairs, self.first_value - 1)
        values = self.first_value + sample_distinct_rows(rng, rows, pairs, self.first_value)
        context = 2 * pairs * self.num_passes
        tokens = np.zeros((rows, length), dtype=np.int64)
        for offset in range(0, context, 2 * pairs):
            tokens[:, offset : offset + 2 * pairs : 2] = keys
            tokens[:, offset + 1 : offset + 2 * pairs : 2] = values
        gaps = weighted_without_replacement(
            rng, rows, pairs, power_law((length - context) // 2, self.power_a)
        )
        query = context + 2 * gaps  # (rows, P): key i is queried at query[:, i]
        np.put_along_axis(tokens, query, keys, axis=1)
        if self.random_non_queries:
            filler = tokens == 0
            filler[:, :context] = False
            tokens[filler] = rng.integers(0, self.vocab_size, size=int(filler.sum()))
        # Rows: one per query, in document order.
        order = np.argsort(query, axis=1)
        query = np.take_along_axis(query, order, axis=1)
        pair = order  # the pair each query asks for
        key = context - 2 * pairs + 2 * pair
        row_document = np.repeat(np.arange(rows), pairs)
        answers = np.take_along_axis(values, pair, axis=1)
        return Batch(
            tokens=torch.from_numpy(tokens[row_document]),
            answers=torch.from_numpy(answers.reshape(-1)),
            positions={
                "key": torch.from_numpy(key.reshape(-1)),
                "value": torch.from_numpy(key.reshape(-1) + 1),
                "query": torch.from_numpy(query.reshape(-1)),
            },
            lengths=torch.full((rows * pairs,), length, dtype=torch.long),
            document=torch.from_numpy(row_document),
        )
