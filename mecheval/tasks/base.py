"""`Task`: the task contract in code, and what every task shares: special tokens, configuration
and cache key, seeded sampling, counterfactual corruption, fixed datasets and readable printing.

A task (docs/tasks.md) declares, on its class:
    name            what configs and run folders call it (`register_task` files it under it)
    splits          its splits ("train", "dev", "test" and any generalisation split)
    roles           the roles every answer names (spans of positions, "query" among them; the
                    read-outs need "key", "value" and "query")
    corruptions     name -> `Corruption`: which role a counterfactual changes and whether the
                    answer changes with it
and writes `vocab_size`, `max_document_length`, `token_name`, `replacement_range` and
`_generate` (documents -> a `Batch`, one row per (document, answer); `Batch.targets` when the
task trains on more than its answers). A concrete task is a frozen dataclass whose fields are
its options (so it is hashable and its configuration is a plain dict). Options named in
`corruption_options` only change how `corrupt` draws replacements, never the documents: they
are part of `config()` and `label()` but not of the data identity (`key()`, the seeded streams,
the dataset cache).

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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch

from mecheval.checks import check_int
from mecheval.tasks.batch import POSITION_NAMES, Batch
from mecheval.tasks.dataset_cache import CACHE_FORMAT, default_cache_dir, load_batch, save_batch

Split = str
SPLITS: tuple[str, ...] = ("train", "dev", "test")
DATASET_SIZES: dict[str, int] = {"train": 100_032, "dev": 320, "test": 320}
"""The study's fixed set sizes (docs/study.md)."""
DATASET_SEED = 0
"""Seed of the fixed datasets: `task.dataset(split, size)` equals `task.sample(size, 0, split)`."""
GENERATOR_VERSION = 1
"""The default generator version of a task (`Task.generator_version`). A task bumps its own
version whenever its generation changes, so cached datasets of an older generator are not
reused (the version is part of the data identity, hence of the seeded streams)."""

# Stream id of a task's first corruption (its others follow, in declaration order): after the
# split ids 0..2, so AR's and ATR's key and value corruptions draw from streams 3 and 4.
_FIRST_CORRUPTION_STREAM = 3


@dataclass(frozen=True)
class Corruption:
    """A named counterfactual of a task: every token of role `role` of each answer replaced by
    another id of `Task.replacement_range(name)`; `answer_changes`: whether the corrupted
    document answers otherwise (False: a control that leaves the answer as it was)."""

    role: str
    answer_changes: bool = True


def check_fraction(option: str, value: Any) -> float:
    """Validate a fraction option in [0, 1); ints are accepted and converted to float."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"option {option!r} must be a float, got {type(value).__name__} {value!r}")
    if not 0.0 <= float(value) < 1.0:
        raise ValueError(f"option {option!r} must be in [0, 1), got {value}")
    return float(value)


def check_split(split: Any, splits: Sequence[str] = SPLITS) -> str:
    if split not in splits:
        raise ValueError(f"split must be one of {tuple(splits)}, got {split!r}")
    return split


class Task(ABC):
    """Base of the tasks; see the module docstring. Subclasses are frozen dataclasses."""

    PAD: ClassVar[int] = 0
    BOS: ClassVar[int] = 1
    EOS: ClassVar[int] = 2
    name: ClassVar[str]
    special_tokens: ClassVar[bool] = True
    """Whether ids 0, 1, 2 are PAD, BOS and EOS (MQAR uses them as ordinary ids)."""
    splits: ClassVar[tuple[str, ...]] = SPLITS
    roles: ClassVar[tuple[str, ...]] = POSITION_NAMES
    corruptions: ClassVar[Mapping[str, Corruption]] = MappingProxyType(
        {"key": Corruption("key"), "value": Corruption("value")}
    )
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
        special = {}
        if self.special_tokens:
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
            split: one of the task's `splits` ("train", "dev", "test", ...).

        Returns:
            a `Batch` on CPU whose width is the longest of its documents: one row per
            (document, answer), the documents in order.
        """
        check_int("n", n, 1)
        check_int("seed", seed, 0)
        return self._generate(n, seed, check_split(split, self.splits))

    @abstractmethod
    def _generate(self, n: int, seed: int, split: str) -> Batch:
        """Implements `sample` (arguments already validated)."""

    def oracle(self, batch: Batch) -> torch.Tensor:
        """(n,) each row's answer read off its document, as a model that recalls perfectly
        would: the token at its `value` role (a task without one writes its own)."""
        if "value" not in batch.positions:
            raise NotImplementedError(f"{self.name} has no value role: write {self.name}.oracle")
        rows = torch.arange(len(batch), device=batch.device)
        return batch.tokens[rows, batch.positions["value"]]

    # ---- counterfactuals -----------------------------------------------------------------

    def token_range(self, role: str) -> tuple[int, int] | None:
        """`[low, high)`: the ids this task's documents hold at role `role`, checked before a
        corruption (None, the default: not checked)."""
        return None

    @abstractmethod
    def replacement_range(self, corruption: str) -> tuple[int, int]:
        """`[low, high)`: the ids corruption `corruption` draws its replacements from."""

    def corruption(self, name: str) -> Corruption:
        """The corruption called `name` (a ValueError naming the task's corruptions)."""
        if name not in self.corruptions:
            raise ValueError(
                f"{self.name} has no corruption {name!r}; its corruptions: "
                + ", ".join(self.corruptions)
            )
        return self.corruptions[name]

    def corruption_metadata(self, name: str) -> dict[str, Any]:
        """How `corrupt(batch, name, seed)` draws, for tables and reports: the corruption, the
        task's corruption options (e.g. AR's `corruption_range`) and the replacement id range.

        Returns:
            `{"at": name, <corruption option>: value, ..., "replacement_low": low,
            "replacement_high": high}` (high exclusive).
        """
        self.corruption(name)
        low, high = self.replacement_range(name)
        options = {option: getattr(self, option) for option in self.corruption_options}
        return {"at": name, **options, "replacement_low": low, "replacement_high": high}

    def corrupt(self, batch: Batch, corruption: str, seed: int) -> torch.Tensor:
        """Counterfactual documents, one per row: every token of the corruption's role in the
        row replaced by an id drawn uniformly from `replacement_range(corruption)`, other than
        the original token when that range holds it; all else unchanged.

        Args:
            batch: documents of this task.
            corruption: one of the task's `corruptions` ("key" or "value" for AR and ATR).
            seed: non-negative int; draws are a function of (task, seed, corruption, rows).

        Returns:
            `LongTensor (n, L)` on `batch.device`.
        """
        role = self.corruption(corruption).role
        check_int("seed", seed, 0)
        if role not in batch.positions:
            raise ValueError(f"corrupt {corruption!r}: the batch names no role {role!r}")
        low, high = self.replacement_range(corruption)
        start, stop = batch.span(role)
        counts = (stop - start).cpu()
        rows = torch.repeat_interleave(torch.arange(len(batch)), counts)
        offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )
        columns = (start.cpu()[rows] + offsets).to(batch.device)
        rows = rows.to(batch.device)
        original = batch.tokens[rows, columns].cpu().numpy()
        own = self.token_range(role)
        if own is not None and ((original < own[0]) | (original >= own[1])).any():
            raise ValueError(
                f"tokens at {role!r} fall outside [{own[0]}, {own[1]}): not this task's"
            )
        inside = (original >= low) & (original < high)
        if high - low < 1 or (high - low < 2 and inside.any()):
            raise ValueError(
                f"corrupt: {self.label()} draws replacements at {role!r} from ids [{low}, {high}), "
                f"which hold {max(high - low, 0)} id(s) and no id other than the original: "
                f"nothing different to draw (the task needs at least 2 {role} ids)"
            )
        stream = _FIRST_CORRUPTION_STREAM + list(self.corruptions).index(corruption)
        rng = self.task_rng(seed, stream)
        if inside.all():
            draw = rng.integers(low, high - 1, size=len(original))
            replacement = draw + (draw >= original)  # skips the original: uniform over the rest
        elif not inside.any():
            replacement = rng.integers(low, high, size=len(original))  # nothing to skip
        else:
            draw = rng.integers(low, high - 1, size=len(original))
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
        split = check_split(split, self.splits)
        size = (
            DATASET_SIZES.get(split, DATASET_SIZES["test"])
            if size is None
            else check_int("size", size, 1)
        )
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
        loaded = load_batch(path, self.roles)
        if loaded is not None and loaded[1] == metadata and loaded[0].num_documents == size:
            return loaded[0]
        batch = self.sample(size, DATASET_SEED, split)
        save_batch(path, batch, metadata)
        return batch
