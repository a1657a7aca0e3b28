"""Associative recall (AR, docs/study.md), generated fully vectorised with NumPy.

Document (P = num_pairs, K = num_keys):

    BOS k1 v1 k2 v2 ... kP vP EOS q a EOS        (2P + 5 tokens; 37 for P = 16)

Key ids are `3 .. 3+K-1`, value ids `3+K .. 3+2K-1`, vocabulary `3 + 2K` (8195 for K = 4096).
The P keys are distinct and the P values are distinct within a document. With `query="key"`
the query is one of the keys, chosen uniformly, and the answer its value; with
`query="value"` (the value-first variant) the query is a value and the answer its key.

Named positions (both query modes): `key = 1 + 2j` and `value = 2 + 2j` for the queried pair
`j` (so for value-first queries `value` holds the in-context copy of the query), `divider =
2P + 1`, `query = 2P + 2`, `answer = 2P + 3`.

Query ids (`query_ids`, value-first queries only): `"own"` (the default) writes the query and
the answer as the in-context tokens (value `v_i`, key `k_j`). `"swapped"` is the value-first
generator the study's `ar_32_value` runs used: the query is the key id with the queried value's
index (`k_i` for `v_i`) and the answer the value id with its key's index (`v_j` for `k_j`), so
neither occurs in the context. The named positions keep their meaning: `value` is where the
query's match lies (its index), `key` where the answer's information lies (its index).

Corruption (`corruption_range`, an option that changes no document):

- `"query"` (the default, the study's): both positions draw their replacement from the ids of
  the query's kind, the key ids for `query="key"` and the value ids for `query="value"`. The
  study's interchange evaluation draws every corrupting token from one id range, keys
  `3 .. 3+K-1` for key queries, whatever the position; so a corrupted value is a key token (and
  the document loses its key/value alternation there).
- `"own"`: each position draws from the ids of its own kind (key ids at `key`, value ids at
  `value`), so the document keeps its key/value alternation.

A replacement never equals the original token (when the range holds it) but may equal another
token of the document, e.g. with probability (P-1)/(K-1) for a key replacing a key.

Held-out pairs (`holdout = h > 0`): a `PairHoldout` over (key, value) pairs marks about a
fraction h of the K*K pairs. Train and dev documents contain no held-out pair at all; a test
document's queried pair is held out, its other pairs are unrestricted. Keys are uniform without
replacement; given the keys, values are uniform over the allowed assignments with distinct
values (coordinate-wise rejection for the pair constraint, then row rejection for
distinctness). A test document's queried pair is uniform over the held-out pairs and its
other keys and values are uniform and distinct. With `holdout = 0` the three splits are
independent streams of one distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from mecheval.checks import check_int
from mecheval.tasks.base import Task, check_fraction
from mecheval.tasks.batch import Batch, concat_batches
from mecheval.tasks.holdout import PairHoldout

BLOCK_SIZE = 4096
"""Documents per generated block (the unit of the seeded stream)."""
MAX_REJECTION_ROUNDS = 10_000


def has_duplicate_in_row(values: np.ndarray) -> np.ndarray:
    """`(rows, P)` int array -> `(rows,)` bool: does the row repeat a value."""
    ordered = np.sort(values, axis=1)
    return (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)


def sample_distinct_rows(rng: np.random.Generator, rows: int, width: int, high: int) -> np.ndarray:
    """Rows of `width` distinct ints, each row a uniform ordered draw without replacement.

    Args:
        rng: the generator.
        rows, width: output shape; requires `width <= high`.
        high: values are in `[0, high)`.

    Returns:
        `(rows, width)` int64 array.
    """
    out = np.empty((rows, width), dtype=np.int64)
    todo = np.arange(rows)
    # Rejection of i.i.d. rows is exact and cheap while collisions are rare (width**2 <= high);
    # rows still colliding after a few rounds use a random permutation instead.
    rounds = 32 if width * width <= high else 0
    for _ in range(rounds):
        if todo.size == 0:
            return out
        out[todo] = rng.integers(0, high, size=(todo.size, width))
        todo = todo[has_duplicate_in_row(out[todo])]
    chunk = max(1, (1 << 22) // high)
    for start in range(0, todo.size, chunk):
        part = todo[start : start + chunk]
        out[part] = np.argsort(rng.random((part.size, high)), axis=1)[:, :width]
    return out


@dataclass(frozen=True)
class AssociativeRecall(Task):
    """Associative recall; see the module docstring.

    Args:
        num_pairs: key-value pairs per document (16 in the study).
        num_keys: number of key ids, and of value ids (4096 in the study).
        query: "key" (query a key, answer its value) or "value" (the value-first variant).
        holdout: fraction of (key, value) pairs held out from train and dev, queried in test.
        corruption_range: "query" (the study's: corruptions at both positions draw from the
            ids of the query's kind) or "own" (each position from the ids of its own kind);
            see the module docstring. It changes no document (not part of `key()`).
        query_ids: "own" (the query and answer are the in-context value and key) or
            "swapped" (with query="value" only: the query is the key id of the value's index,
            the answer the value id of the key's index, as in the study's ar_32_value runs).
    """

    num_pairs: int = 16
    num_keys: int = 4096
    query: Literal["key", "value"] = "key"
    holdout: float = 0.0
    corruption_range: Literal["query", "own"] = "query"
    query_ids: Literal["own", "swapped"] = "own"
    name = "ar"
    corruption_options = ("corruption_range",)
    _pairs_held_out: PairHoldout | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._set_option("num_pairs", check_int("num_pairs", self.num_pairs, 1))
        self._set_option("num_keys", check_int("num_keys", self.num_keys, 1))
        if self.num_keys < self.num_pairs:
            raise ValueError(
                f"option 'num_keys' ({self.num_keys}) must be >= num_pairs ({self.num_pairs}):"
                " keys within a document are distinct"
            )
        if self.query not in ("key", "value"):
            raise ValueError(f"option 'query' must be 'key' or 'value', got {self.query!r}")
        if self.corruption_range not in ("query", "own"):
            raise ValueError(
                f"option 'corruption_range' must be 'query' or 'own', got {self.corruption_range!r}"
            )
        if self.query_ids not in ("own", "swapped"):
            raise ValueError(
                f"option 'query_ids' must be 'own' or 'swapped', got {self.query_ids!r}"
            )
        if self.query_ids == "swapped" and self.query != "value":
            raise ValueError("option query_ids='swapped' needs query='value' (value-first)")
        self._set_option("holdout", check_fraction("holdout", self.holdout))
        held_out = None
        if self.holdout > 0:
            if self.num_pairs**2 > self.num_keys:
                raise ValueError(
                    f"option 'holdout' needs num_pairs**2 <= num_keys (got {self.num_pairs}**2 >"
                    f" {self.num_keys}): values are drawn by rejection"
                )
            held_out = PairHoldout(self.num_keys, self.num_keys, self.holdout, salt=1)
            if held_out.threshold == 0:
                raise ValueError(f"option 'holdout'={self.holdout} holds out no pair at all")
        self._set_option("_pairs_held_out", held_out)

    def config(self) -> dict[str, Any]:
        """The options, `query_ids` only when it is not "own" (so other tasks keep the data
        identity, hence the documents and cache keys, they had before the option)."""
        config = super().config()
        if config["query_ids"] == "own":
            del config["query_ids"]
        return config

    @property
    def pairs_held_out(self) -> PairHoldout | None:
        """The held-out (key index, value index) pairs, or None when `holdout == 0`."""
        return self._pairs_held_out

    # ---- vocabulary ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return 3 + 2 * self.num_keys

    @property
    def first_key(self) -> int:
        return 3

    @property
    def first_value(self) -> int:
        return 3 + self.num_keys

    @property
    def length(self) -> int:
        """Tokens per document, 2 * num_pairs + 5."""
        return 2 * self.num_pairs + 5

    @property
    def max_document_length(self) -> int:
        return self.length

    def token_name(self, token: int) -> str:
        if self.first_key <= token < self.first_value:
            return f"k{token - self.first_key}"
        if self.first_value <= token < self.vocab_size:
            return f"v{token - self.first_value}"
        raise ValueError(f"token id {token} is not in the AR vocabulary (size {self.vocab_size})")

    def token_range(self, at: str) -> tuple[int, int]:
        """Key ids at `key`, value ids at `value` (either query mode)."""
        if at == "key":
            return self.first_key, self.first_value
        if at == "value":
            return self.first_value, self.vocab_size
        raise ValueError(f"at must be 'key' or 'value', got {at!r}")

    def replacement_range(self, at: str) -> tuple[int, int]:
        """With `corruption_range="query"` the ids of the query's kind at both positions (key
        ids `[3, 3+K)` for `query="key"`); with `"own"` the ids of the position's own kind."""
        own = self.token_range(at)
        if self.corruption_range == "own":
            return own
        return self.token_range(self.query)

    # ---- generation ----------------------------------------------------------------------

    def _generate(self, n: int, seed: int, split: str) -> Batch:
        stream = ("train", "dev", "test").index(split)
        blocks = []
        for block in range(-(-n // BLOCK_SIZE)):
            rng = self.task_rng(seed, stream, block)
            blocks.append(self._sample_block(rng, split))
        return concat_batches(blocks)[:n] if len(blocks) > 1 else blocks[0][:n]

    def _sample_block(self, rng: np.random.Generator, split: str) -> Batch:
        rows, pairs = BLOCK_SIZE, self.num_pairs
        keys = sample_distinct_rows(rng, rows, pairs, self.num_keys)
        queried = rng.integers(0, pairs, size=rows)
        if self.pairs_held_out is None:
            values = sample_distinct_rows(rng, rows, pairs, self.num_keys)
        elif split == "test":
            values = sample_distinct_rows(rng, rows, pairs, self.num_keys)
            self._place_held_out_pairs(rng, keys, values, queried)
        else:
            values = self._sample_allowed_values(rng, keys)

        tokens = np.empty((rows, self.length), dtype=np.int64)
        tokens[:, 0] = self.BOS
        tokens[:, 1 : 2 * pairs + 1 : 2] = keys + self.first_key
        tokens[:, 2 : 2 * pairs + 2 : 2] = values + self.first_value
        divider = 2 * pairs + 1
        tokens[:, divider] = self.EOS
        key_position = 1 + 2 * queried
        query_column = key_position if self.query == "key" else key_position + 1
        answer_column = key_position + 1 if self.query == "key" else key_position
        row_index = np.arange(rows)
        tokens[:, divider + 1] = tokens[row_index, query_column]
        tokens[:, divider + 2] = tokens[row_index, answer_column]
        if self.query_ids == "swapped":
            tokens[:, divider + 1] = values[row_index, queried] + self.first_key
            tokens[:, divider + 2] = keys[row_index, queried] + self.first_value
        tokens[:, divider + 3] = self.EOS

        def column(value: int) -> torch.Tensor:
            return torch.full((rows,), value, dtype=torch.long)

        return Batch(
            tokens=torch.from_numpy(tokens),
            answers=torch.from_numpy(tokens[:, divider + 2].copy()),
            positions={
                "key": torch.from_numpy(key_position),
                "value": torch.from_numpy(key_position + 1),
                "divider": column(divider),
                "query": column(divider + 1),
                "answer": column(divider + 2),
            },
            lengths=column(self.length),
        )

    def _sample_allowed_values(self, rng: np.random.Generator, keys: np.ndarray) -> np.ndarray:
        """Distinct values per row with no (key, value) pair held out.

        Each coordinate is redrawn until its pair is allowed (uniform over the key's allowed
        values), then rows that repeat a value are redrawn whole.

        Args:
            keys: `(rows, P)` key indices.

        Returns:
            `(rows, P)` value indices.
        """
        values = np.empty_like(keys)
        todo_rows = np.arange(keys.shape[0])
        for _ in range(MAX_REJECTION_ROUNDS):
            if todo_rows.size == 0:
                return values
            part_keys = keys[todo_rows]
            part = rng.integers(0, self.num_keys, size=part_keys.shape)
            bad = self.pairs_held_out.is_held_out(part_keys, part)
            # A coordinate is accepted with probability about 1 - h per round; this bound makes
            # a failure (probability ~exp(-50) per coordinate) a real anomaly.
            for _ in range(max(MAX_REJECTION_ROUNDS, int(50 / (1 - self.holdout)))):
                if not bad.any():
                    break
                part[bad] = rng.integers(0, self.num_keys, size=int(bad.sum()))
                bad[bad] = self.pairs_held_out.is_held_out(part_keys[bad], part[bad])
            else:
                raise RuntimeError("AR holdout: could not draw values outside the held-out pairs")
            values[todo_rows] = part
            todo_rows = todo_rows[has_duplicate_in_row(part)]
        raise RuntimeError("AR holdout: could not draw distinct values for some documents")

    def _place_held_out_pairs(
        self, rng: np.random.Generator, keys: np.ndarray, values: np.ndarray, queried: np.ndarray
    ) -> None:
        """Make the queried pair of each row a held-out pair, uniform over held-out pairs; the
        other keys and values stay uniform and distinct (rows that collide are redrawn).

        Args:
            keys, values: `(rows, P)` index arrays, modified in place.
            queried: `(rows,)` index of the queried pair in each row.
        """
        rows = np.arange(keys.shape[0])
        pair_keys = np.empty(len(rows), dtype=np.int64)
        pair_values = np.empty(len(rows), dtype=np.int64)
        todo = rows
        # Pairs are accepted with probability about h per round.
        for _ in range(max(MAX_REJECTION_ROUNDS, int(50 / self.holdout))):
            if todo.size == 0:
                break
            pair_keys[todo] = rng.integers(0, self.num_keys, size=todo.size)
            pair_values[todo] = rng.integers(0, self.num_keys, size=todo.size)
            todo = todo[~self.pairs_held_out.is_held_out(pair_keys[todo], pair_values[todo])]
        else:
            raise RuntimeError("AR holdout: could not draw held-out pairs to query")
        for array, chosen in ((keys, pair_keys), (values, pair_values)):
            array[rows, queried] = chosen
            todo = rows[has_duplicate_in_row(array)]
            for _ in range(MAX_REJECTION_ROUNDS):
                if todo.size == 0:
                    break
                array[todo] = rng.integers(0, self.num_keys, size=(todo.size, array.shape[1]))
                array[todo, queried[todo]] = chosen[todo]
                todo = todo[has_duplicate_in_row(array[todo])]
            else:
                raise RuntimeError("AR holdout: could not draw distinct items around the query")
