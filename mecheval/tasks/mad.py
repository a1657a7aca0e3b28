"""MAD's recall tasks (Poli et al. 2024, "Mechanistic Design and Scaling of Hybrid
Architectures"), drawn as mad-lab's generators draw them, their settings as options.

In-context recall (`mad_recall`; with noise, `mad_noisy_recall`): a document is seq_len / 2
key-value pairs, keys drawn with replacement from the key ids, each key's value fixed within
the document (drawn from the value ids the first time the key appears); with frac_noise > 0 a
pair is, with that probability, two noise ids instead. The last pair repeats a key seen before
(after a copy-prefix id unless multi_query). Fuzzy recall (`mad_fuzzy_recall`): keys and values
are motifs of 1..k_motif_size and 1..v_motif_size distinct ids (keys of k_motif_size ids
outside training); one probe pair is placed among the others and repeated at the end; documents
are padded on the left to seq_len. Where mad-lab's generator leaves the probe out of the
context (its length bound reached first: a few documents in a hundred), the document is drawn
again here, so that every final probe can be answered (docs/deviations.md).

Ids: keys are the lower half of the non-special ids, values the upper half, then the noise ids;
the copy prefix (and fuzzy recall's padding) are the last ids. No BOS, EOS or PAD.

Answers (rows): the final probe's value, and with multi_query every value of a key seen
before, as mad-lab's test targets (for fuzzy recall, a value's first id: its others follow by
copying). Training learns every next token (`Batch.targets`), as mad-lab trains; the train
split's rows are the final probe alone. Roles of a row: `query` (the repeated key: its span,
anchored at its last id, which predicts the answer), `key` (the latest earlier occurrence of
the queried key: its span, anchored at its last id), `value` (that occurrence's value: its
span, anchored at its first id). Corruptions: `key`, `value`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from mecheval.checks import check_int
from mecheval.tasks.base import Task, check_fraction
from mecheval.tasks.batch import Batch

# A document's recall: (query position, answer id, key span, value span, query span), spans
# [start, stop).
Recall = tuple[int, int, tuple[int, int], tuple[int, int], tuple[int, int]]


@dataclass(frozen=True)
class _MadRecall(Task):
    """What the three recall tasks share: ids, splits, roles, rows from drawn documents."""

    roles: ClassVar[tuple[str, ...]] = ("key", "value", "query")
    special_tokens: ClassVar[bool] = False

    def _check_common(self) -> None:
        self._set_option("vocab_size", check_int("vocab_size", self.vocab_size, 4))
        self._set_option("seq_len", check_int("seq_len", self.seq_len, 4))
        self._set_option(
            "noise_vocab_size", check_int("noise_vocab_size", self.noise_vocab_size, 0)
        )
        self._set_option("frac_noise", check_fraction("frac_noise", self.frac_noise))
        if self.frac_noise > 0 and self.noise_vocab_size == 0:
            raise ValueError("option 'frac_noise' > 0 needs noise_vocab_size > 0")
        if not isinstance(self.multi_query, bool):
            raise TypeError("option 'multi_query' must be true or false")
        if self.key_ids < 1:
            raise ValueError(
                f"vocab_size {self.vocab_size} leaves no key ids after {self.special_ids} "
                f"special and {self.noise_vocab_size} noise ids"
            )

    @property
    def special_ids(self) -> int:
        """Ids at the top of the vocabulary that are not keys, values or noise: the copy
        prefix (without multi_query) and fuzzy recall's padding."""
        return int(not self.multi_query) + int(isinstance(self, FuzzyRecall))

    @property
    def key_ids(self) -> int:
        return self.first_noise // 2

    @property
    def first_noise(self) -> int:
        """Keys are [0, key_ids), values [key_ids, first_noise), then the noise ids."""
        return self.vocab_size - self.special_ids - self.noise_vocab_size

    @property
    def max_document_length(self) -> int:
        return self.seq_len

    def token_name(self, token: int) -> str:
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token id {token} is not in the vocabulary (size {self.vocab_size})")
        if token < self.key_ids:
            return f"k{token}"
        if token < self.first_noise:
            return f"v{token}"
        if token < self.first_noise + self.noise_vocab_size:
            return f"n{token}"
        return "COPY" if token == self.vocab_size - 1 and not self.multi_query else "PAD"

    def token_range(self, role: str) -> tuple[int, int] | None:
        return {"key": (0, self.key_ids), "value": (self.key_ids, self.first_noise)}.get(role)

    def replacement_range(self, corruption: str) -> tuple[int, int]:
        return self.token_range(self.corruption(corruption).role)

    def _generate(self, n: int, seed: int, split: str) -> Batch:
        rng = self.task_rng(seed, self.splits.index(split))
        documents = []
        while len(documents) < n:
            document = self._document(rng, training=split == "train")
            if document is not None:
                documents.append(document)
        return self._rows(documents, split)

    def _rows(self, documents: list, split: str) -> Batch:
        """Rows from (ids, recalls, how many recalls the final probe has) per document."""
        tokens, targets, rows = [], [], []
        for index, (sequence, recalls, final) in enumerate(documents):
            tokens.append(sequence[:-1])
            targets.append(sequence[1:])
            kept = recalls[len(recalls) - final :][:1] if split == "train" else recalls
            rows += [(index, *recall) for recall in kept]
        tokens, targets = np.stack(tokens), np.stack(targets)
        document = np.array([r[0] for r in rows])
        key = np.array([r[3] for r in rows])
        value = np.array([r[4] for r in rows])
        query = np.array([r[5] for r in rows])
        length = tokens.shape[1]

        def tensor(values) -> torch.Tensor:
            return torch.as_tensor(np.asarray(values, dtype=np.int64))

        return Batch(
            tokens=tensor(tokens[document]),
            answers=tensor([r[2] for r in rows]),
            positions={
                "key": tensor(key[:, 1] - 1),
                "value": tensor(value[:, 0]),
                "query": tensor([r[1] for r in rows]),
            },
            lengths=torch.full((len(rows),), length, dtype=torch.long),
            document=tensor(document),
            spans={"key": tensor(key), "value": tensor(value), "query": tensor(query)},
            targets=tensor(targets[document]),
        )


@dataclass(frozen=True)
class InContextRecall(_MadRecall):
    """MAD's in-context recall (and, with frac_noise > 0, noisy recall).

    Args:
        vocab_size: ids in all (16 in MAD's baseline; 32 for noisy recall).
        seq_len: tokens per document (even; 128).
        multi_query: every repeated key is a query (MAD's baseline), else the last alone.
        noise_vocab_size: noise ids (16 for noisy recall, else 0).
        frac_noise: probability that a pair is noise instead (0.2 for noisy recall).
    """

    vocab_size: int = 16
    seq_len: int = 128
    multi_query: bool = True
    noise_vocab_size: int = 0
    frac_noise: float = 0.0
    name: ClassVar[str] = "mad_recall"

    def __post_init__(self) -> None:
        self._check_common()
        if self.seq_len % 2:
            raise ValueError(f"option 'seq_len' must be even, got {self.seq_len}")

    def _document(self, rng: np.random.Generator, training: bool) -> tuple[np.ndarray, list]:
        """(the ids before the shift into inputs and targets, the recalls, 1: the final
        probe's recalls)."""
        pairs = self.seq_len // 2
        values: dict[int, int] = {}
        last: dict[int, int] = {}  # key -> position of its latest occurrence
        sequence: list[int] = []
        recalls: list[Recall] = []
        sure = rng.integers(pairs)  # one pair is never noise
        for i in range(pairs - 1):
            if self.frac_noise > 0 and i != sure and rng.random() < self.frac_noise:
                sequence += list(
                    rng.integers(self.first_noise, self.first_noise + self.noise_vocab_size, 2)
                )
                continue
            key = int(rng.integers(self.key_ids))
            value = values.setdefault(key, int(rng.integers(self.key_ids, self.first_noise)))
            if key in last and self.multi_query:
                recalls.append(self._recall(len(sequence), value, last[key]))
            last[key] = len(sequence)
            sequence += [key, value]
        probe = int(rng.choice(sorted(last)))
        if not self.multi_query:
            sequence.append(self.vocab_size - 1)
        recalls.append(self._recall(len(sequence), values[probe], last[probe]))
        sequence += [probe, values[probe]]
        return np.asarray(sequence), recalls, 1

    @staticmethod
    def _recall(query: int, answer: int, key: int) -> Recall:
        return query, answer, (key, key + 1), (key + 1, key + 2), (query, query + 1)


@dataclass(frozen=True)
class NoisyRecall(InContextRecall):
    """MAD's noisy in-context recall: in-context recall with MAD's noise settings (vocabulary
    32, 16 noise ids, a pair noise with probability 0.2) as defaults."""

    vocab_size: int = 32
    noise_vocab_size: int = 16
    frac_noise: float = 0.2
    name: ClassVar[str] = "mad_noisy_recall"


@dataclass(frozen=True)
class FuzzyRecall(_MadRecall):
    """MAD's fuzzy in-context recall: keys and values of several ids.

    Args:
        vocab_size: ids in all (16 in MAD's baseline).
        seq_len: tokens per document (128).
        k_motif_size, v_motif_size: the most ids of a key and of a value (3 and 3).
        multi_query: every repeated key is a query (MAD's baseline), else the probe alone.
        noise_vocab_size, frac_noise: noise ids, and the probability of a noise motif.
    """

    vocab_size: int = 16
    seq_len: int = 128
    k_motif_size: int = 3
    v_motif_size: int = 3
    multi_query: bool = True
    noise_vocab_size: int = 0
    frac_noise: float = 0.0
    name: ClassVar[str] = "mad_fuzzy_recall"

    def __post_init__(self) -> None:
        self._check_common()
        self._set_option("k_motif_size", check_int("k_motif_size", self.k_motif_size, 1))
        self._set_option("v_motif_size", check_int("v_motif_size", self.v_motif_size, 1))
        longest = max(self.k_motif_size, self.v_motif_size)
        if longest > self.key_ids:
            raise ValueError(
                f"motifs of {longest} distinct ids need {longest} key ids, got {self.key_ids}"
            )
        if 4 * (self.k_motif_size + self.v_motif_size) >= self.seq_len:
            raise ValueError(f"option 'seq_len' {self.seq_len} is too short for the motif sizes")

    @staticmethod
    def _motif(rng: np.random.Generator, size: int, low: int, high: int) -> tuple[int, ...]:
        """`size` distinct ids of [low, high), in a uniform order."""
        return tuple(int(t) for t in low + rng.permutation(high - low)[:size])

    def _document(self, rng: np.random.Generator, training: bool) -> tuple[np.ndarray, list]:
        k_sizes = range(1, self.k_motif_size + 1) if training else [self.k_motif_size]
        v_sizes = range(1, self.v_motif_size + 1)
        keys, values_ = (0, self.key_ids), (self.key_ids, self.first_noise)
        k_probe = self._motif(rng, int(rng.choice(k_sizes)), *keys)
        v_probe = self._motif(rng, int(rng.choice(v_sizes)), *values_)
        probe_size = len(k_probe) + len(v_probe)
        probe_at = rng.integers(self.seq_len - 2 * probe_size)
        values: dict[tuple, tuple] = {k_probe: v_probe}
        last: dict[tuple, int] = {}
        sequence: list[int] = []
        recalls: list[Recall] = []
        placed = False
        while len(sequence) < self.seq_len - probe_size - self.k_motif_size - self.v_motif_size:
            k_size, v_size = int(rng.choice(k_sizes)), int(rng.choice(v_sizes))
            if len(sequence) >= probe_at and not placed:
                key, placed = k_probe, True
            elif self.frac_noise > 0 and rng.random() < self.frac_noise:
                noise = rng.integers(
                    self.first_noise, self.first_noise + self.noise_vocab_size, k_size + v_size
                )
                sequence += [int(t) for t in noise]
                continue
            else:
                key = self._motif(rng, k_size, *keys)
                placed = placed or key == k_probe
            if key not in values:
                values[key] = self._motif(rng, v_size, *values_)
            value = values[key]
            if key in last and self.multi_query:
                recalls.append(self._fuzzy_recall(len(sequence), key, value, last[key]))
            last[key] = len(sequence)
            sequence += [*key, *value]
        if k_probe not in last:
            return None  # the probe never fitted in (a few in a hundred): drawn again
        if not self.multi_query:
            sequence.append(self.vocab_size - 1)
        recalls.append(self._fuzzy_recall(len(sequence), k_probe, v_probe, last[k_probe]))
        sequence += [*k_probe, *v_probe]
        pad = self.seq_len + 1 - len(sequence)
        shifted = [
            (q + pad, a, *((start + pad, stop + pad) for start, stop in spans))
            for q, a, *spans in recalls
        ]
        ids = np.asarray([self.vocab_size - self.special_ids] * pad + sequence)
        return ids, shifted, 1

    @staticmethod
    def _fuzzy_recall(at: int, key: tuple, value: tuple, earlier: int) -> Recall:
        """The recall of `value`'s first id after `key` placed at `at` (predicted at the key's
        last id); spans of the earlier occurrence at `earlier`."""
        key_span = (earlier, earlier + len(key))
        value_span = (key_span[1], key_span[1] + len(value))
        query = at + len(key) - 1
        return query, value[0], key_span, value_span, (at, at + len(key))
