"""`Task`: what every task shares — special tokens, configuration and cache key, seeded
sampling, counterfactual corruption, fixed datasets and readable printing.

A concrete task is a frozen dataclass whose fields are its options (so it is hashable and
its configuration is a plain dict); it implements `vocab_size`, `token_name`, `token_range`,
`replacement_range` and `_generate`. Options named in `corruption_options` only change how
`corrupt` draws replacements, never the documents: they are part of `config()` and `label()`
but not of the data identity (`key()`, the seeded streams, the dataset cache).

Randomness: every document stream is drawn from NumPy's PCG64 seeded by a `SeedSequence` of
(digest of the task's `data_config()` and generator version, the caller's seed, the split, a
block counter), so data are a pure function of `(task configuration, seed, split)`; see
`task_rng`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from mecheval.tasks.batch import Batch
from mecheval.tasks.dataset_cache import CACHE_FORMAT, default_cache_dir, load_batch, save_batch

Split = Literal["train", "dev", "test"]
SPLITS: tuple[str, ...] = ("train", "dev", "test")
DATASET_SIZES: dict[str, int] = {"train": 100_032, "dev": 320, "test": 320}
"""The study's fixed set sizes (docs/study.md)."""
DATASET_SEED = 0
"""Seed of the fixed datasets: `task.dataset(split, size)` equals `task.sample(size, 0, split)`."""
GENERATOR_VERSION = 1
"""The default generator version of a task (`Task.generator_version`). A task bumps its own
version whenever its generation changes, so cached datasets of an older generator are not
reused (the version is part of the data identity, hence of the seeded streams)."""

# Stream ids that follow the split ids 0..2 in the seed sequence.
_CORRUPT_STREAM = {"key": 3, "value": 4}


def check_int(option: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """Validate an integer option (bools refused); raises TypeError/ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"option {option!r} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"option {option!r} must be {bound}, got {value}")
    return int(value)


def check_fraction(option: str, value: Any) -> float:
    """Validate a fraction option in [0, 1); ints are accepted and converted to float."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"option {option!r} must be a float, got {type(value).__name__} {value!r}")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"option {option!r} must be in [0, 1), got {value}")
    return float(value)


def check_split(split: Any) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return split


class Task(ABC):
    """Base of the tasks; see the module docstring. Subclasses are frozen dataclasses."""

    PAD: ClassVar[int] = 0
    BOS: ClassVar[int] = 1
    EOS: ClassVar[int] = 2
    name: ClassVar[str]
    generator_version: ClassVar[int] = GENERATOR_VERSION
    corruption_options: ClassVar[tuple[str, ...]] = ()
    """Options that only affect `corrupt` (left out of the data identity)."""

    # ---- configuration -------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """The task's options as a JSON-serialisable dict; `make_task(name, **config)` rebuilds
        an equal task."""
        return {field.name: getattr(self, field.name) for field in self._option_fields()}

    def _set_option(self, name: str, value: Any) -> None:
        """Store a validated, normalised option (the dataclass is frozen)."""
        object.__setattr__(self, name, value)

    def _option_fields(self) -> list[dataclasses.Field]:
        return [field for field in dataclasses.fields(self) if field.init]

    def data_config(self) -> dict[str, Any]:
        """`config()` without the `corruption_options`: the options that decide the documents."""
        config = self.config()
        return {
            name: value for name, value in config.items() if name not in self.corruption_options
        }

    def key(self) -> str:
        """A stable identifier of the task's documents (its `data_config()` and generator
        version), e.g. `"ar-3f2a...`"; equal configurations give equal keys across runs and
        machines."""
        return f"{self.name}-{self._digest().hex()[:20]}"

    def label(self) -> str:
        """A short readable name: the task name with its non-default options."""
        shown = [
            f"{field.name}={getattr(self, field.name)!r}"
            for field in self._option_fields()
            if getattr(self, field.name) != self._default_of(field)
        ]
        return f"{self.name}({', '.join(shown)})"

    def _default_of(self, option: dataclasses.Field) -> Any:
        """The default value of an option as stored (MISSING for required options)."""
        return option.default

    def _digest(self) -> bytes:
        payload = {
            "task": self.name,
            "config": self.data_config(),
            "generator": self.generator_version,
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).digest()

    def task_rng(self, seed: int, stream: int, block: int = 0) -> np.random.Generator:
        """The generator of one block of one stream (splits are streams 0..2).

        Args:
            seed: the caller's seed, a non-negative int.
            stream: which stream (split index, or a corruption stream).
            block: counter of successive blocks within the stream.
        """
        words = np.frombuffer(self._digest()[:16], dtype=np.uint32).tolist()
        sequence = np.random.SeedSequence([*words, seed, stream, block])
        return np.random.Generator(np.random.PCG64(sequence))

    # ---- vocabulary and printing ---------------------------------------------------------

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids, including PAD/BOS/EOS."""

    @property
    @abstractmethod
    def max_document_length(self) -> int:
        """The longest document this task can produce, in tokens (what a model must accept)."""

    @abstractmethod
    def token_name(self, token: int) -> str:
        """A readable name of one task-specific token id (ids >= 3)."""

    def format(self, tokens: torch.Tensor | Sequence[int] | np.ndarray) -> str:
        """One document as readable text, e.g. `"BOS k12 v7 ... EOS k12 v7 EOS"`.

        Args:
            tokens: one document, 1-D (a row of `Batch.tokens`); trailing PAD is dropped.
        """
        ids = torch.as_tensor(tokens).cpu()
        if ids.dim() != 1:
            raise ValueError(f"format takes one document (1-D), got shape {tuple(ids.shape)}")
        ids = ids.tolist()
        while ids and ids[-1] == self.PAD:
            ids.pop()
        special = {self.PAD: "PAD", self.BOS: "BOS", self.EOS: "EOS"}
        return " ".join(special[i] if i in special else self.token_name(i) for i in ids)

    # ---- sampling ------------------------------------------------------------------------

    def sample(self, n: int, seed: int, split: Split = "train") -> Batch:
        """`n` documents, a pure function of (task configuration, `seed`, `split`).

        The stream is generated in fixed blocks, so `sample(n, seed, split)` is the first `n`
        documents of `sample(m, seed, split)` for any `m >= n`.

        Args:
            n: number of documents, >= 1.
            seed: non-negative int.
            split: "train", "dev" or "test" (they differ only when the task holds pairs out).

        Returns:
            a `Batch` on CPU whose width is the longest of its documents.
        """
        check_int("n", n, 1)
        check_int("seed", seed, 0)
        return self._generate(n, seed, check_split(split))

    @abstractmethod
    def _generate(self, n: int, seed: int, split: str) -> Batch:
        """Implements `sample` (arguments already validated)."""

    # ---- counterfactuals -----------------------------------------------------------------

    @abstractmethod
    def token_range(self, at: str) -> tuple[int, int]:
        """`[low, high)`: the ids this task's documents hold at position `at` ("key"/"value")."""

    @abstractmethod
    def replacement_range(self, at: str) -> tuple[int, int]:
        """`[low, high)`: the ids a corruption at position `at` ("key"/"value") draws from."""

    def corruption_metadata(self, at: str) -> dict[str, Any]:
        """How `corrupt(batch, at, seed)` draws, for tables and reports: the position, the
        task's corruption options (e.g. AR's `corruption_range`) and the replacement id range.

        Returns:
            `{"at": at, <corruption option>: value, ..., "replacement_low": low,
            "replacement_high": high}` (high exclusive).
        """
        if at not in _CORRUPT_STREAM:
            raise ValueError(f"at must be 'key' or 'value', got {at!r}")
        low, high = self.replacement_range(at)
        options = {name: getattr(self, name) for name in self.corruption_options}
        return {"at": at, **options, "replacement_low": low, "replacement_high": high}

    def corrupt(self, batch: Batch, at: Literal["key", "value"], seed: int) -> torch.Tensor:
        """Counterfactual documents: the token at position `at` of each document replaced by a
        token drawn uniformly from `replacement_range(at)`, other than the original token when
        that range holds it; all else unchanged.

        Args:
            batch: documents of this task.
            at: "key" or "value", a named position of `batch`.
            seed: non-negative int; draws are a function of (task, seed, at, batch order).

        Returns:
            `LongTensor (n, L)` on `batch.device`.
        """
        if at not in _CORRUPT_STREAM:
            raise ValueError(f"at must be 'key' or 'value', got {at!r}")
        check_int("seed", seed, 0)
        own_low, own_high = self.token_range(at)
        low, high = self.replacement_range(at)
        rows = torch.arange(len(batch), device=batch.device)
        columns = batch.positions[at]
        original = batch.tokens[rows, columns].cpu().numpy()
        if ((original < own_low) | (original >= own_high)).any():
            raise ValueError(
                f"tokens at {at!r} fall outside [{own_low}, {own_high}): not this task's"
            )
        inside = (original >= low) & (original < high)
        if high - low < 1 or (high - low < 2 and inside.any()):
            raise ValueError(
                f"corrupt: {self.label()} draws replacements at {at!r} from ids [{low}, {high}), "
                f"which hold {max(high - low, 0)} id(s) and no id other than the original: "
                f"nothing different to draw (the task needs at least 2 {at} ids)"
            )
        rng = self.task_rng(seed, _CORRUPT_STREAM[at])
        if inside.all():
            draw = rng.integers(low, high - 1, size=len(batch))
            replacement = draw + (draw >= original)  # skips the original: uniform over the rest
        elif not inside.any():
            replacement = rng.integers(low, high, size=len(batch))  # nothing to skip
        else:
            draw = rng.integers(low, high - 1, size=len(batch))
            replacement = np.where(inside, draw + (draw >= original), 0)
            replacement[~inside] = rng.integers(low, high, size=int((~inside).sum()))
        corrupted = batch.tokens.clone()
        corrupted[rows, columns] = torch.from_numpy(replacement).to(batch.device)
        return corrupted

    # ---- fixed datasets ------------------------------------------------------------------

    def dataset(
        self, split: Split, size: int | None = None, cache_dir: str | Path | None = None
    ) -> Batch:
        """The study's fixed set of a split, cached on disk.

        Equals `self.sample(size, DATASET_SEED, split)`. The first call writes it to
        `cache_dir/tasks/<key>-<split>-<size>.safetensors` (atomically); later calls, in this
        or any other process, read that file.

        Args:
            split: "train", "dev" or "test".
            size: number of documents; default `DATASET_SIZES[split]` (100,032 / 320 / 320).
            cache_dir: cache root; default `$MECHEVAL_CACHE`, else `~/.cache/mecheval`.
        """
        split = check_split(split)
        size = DATASET_SIZES[split] if size is None else check_int("size", size, 1)
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        path = root / "tasks" / f"{self.key()}-{split}-{size}.safetensors"
        metadata = {
            "task": self.name,
            "config": json.dumps(self.data_config(), sort_keys=True),
            "split": split,
            "size": str(size),
            "seed": str(DATASET_SEED),
            "generator_version": str(self.generator_version),
            "format": CACHE_FORMAT,
        }
        loaded = load_batch(path)
        if loaded is not None and loaded[1] == metadata and len(loaded[0]) == size:
            return loaded[0]
        batch = self.sample(size, DATASET_SEED, split)
        save_batch(path, batch, metadata)
        return batch
