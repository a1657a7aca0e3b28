"""`Batch`: documents of a task, one row per (document, answer), with each answer's roles.

Every task returns its documents as one `Batch` (the task contract: docs/tasks.md). A row is one
answer of one document: the document's tokens, the answer, and where each of the answer's roles
lies in the document (`positions`: the role's anchor; `spans`: the tokens a role covers when it
covers several). A document with several answers (MQAR's queries) has several adjacent rows
holding the same tokens and the same `document` id. Training slices whole documents
(`take_documents`); the interventions run one row per cell and read its roles.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

REQUIRED_ROLES: tuple[str, ...] = ("query",)
"""Every answer names its query: the position whose next-token prediction is the answer."""
POSITION_NAMES: tuple[str, ...] = ("key", "value", "divider", "query", "answer")
"""The roles of the study's two tasks, AR and ATR (docs/study.md)."""
IGNORE = -100
"""A `targets` entry that carries no loss."""


@dataclass(frozen=True)
class Batch:
    """Rows of (document, answer), right-padded, with the answer and its roles.

    Attributes:
        tokens: `LongTensor (n, L)`, each row's document right-padded with `PAD` (id 0).
        answers: `LongTensor (n,)`, the token each row's query position predicts.
        positions: role -> `LongTensor (n,)`, the role's anchor position in the row's document
            (at least "query"; AR's: key, value, divider, query, answer).
        lengths: `LongTensor (n,)`, the unpadded length of each row's document.
        document: `LongTensor (n,)` or None: the document each row belongs to; rows of one
            document are adjacent and hold equal tokens. None: every row is its own document.
        spans: role -> `LongTensor (n, 2)`, [start, stop) of a role covering several tokens
            (the anchor inside it); a role not here covers its anchor alone.
        targets: `LongTensor (n, L)` or None: where the task trains on more than its answers,
            the token each position predicts (`IGNORE` elsewhere; equal across a document's
            rows). None: the loss is each row's answer at its query (the study's masking).

    Indexing (`batch[3]`, `batch[2:10]`, `batch[index_tensor]`, `batch[bool_mask]`) selects
    rows and returns a `Batch` (an integer gives one row); `take_documents` selects whole
    documents. Indexing keeps the width `L`; `trim()` drops padding columns no row uses.
    """

    tokens: torch.Tensor
    answers: torch.Tensor
    positions: dict[str, torch.Tensor]
    lengths: torch.Tensor
    document: torch.Tensor | None = None
    spans: Mapping[str, torch.Tensor] = field(default_factory=dict)
    targets: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be 2-D (n, L), got shape {tuple(self.tokens.shape)}")
        n, width = self.tokens.shape
        if self.tokens.dtype != torch.long:
            raise TypeError(f"tokens must be int64 (LongTensor), got {self.tokens.dtype}")
        missing = [role for role in REQUIRED_ROLES if role not in self.positions]
        if missing:
            raise ValueError(
                f"positions must name the role(s) {missing}, got {sorted(self.positions)}"
            )
        unknown = sorted(set(self.spans) - set(self.positions))
        if unknown:
            raise ValueError(f"spans name role(s) {unknown} that positions does not")
        shapes = {"answers": (n,), "lengths": (n,)}
        shapes |= {f"positions[{role!r}]": (n,) for role in self.positions}
        shapes |= {f"spans[{role!r}]": (n, 2) for role in self.spans}
        if self.document is not None:
            shapes["document"] = (n,)
        if self.targets is not None:
            shapes["targets"] = (n, width)
        for label, expected in shapes.items():
            tensor = self._field(label)
            if tensor.dtype != torch.long:
                raise TypeError(f"{label} must be int64 (LongTensor), got {tensor.dtype}")
            if tensor.device != self.tokens.device:
                raise ValueError(f"{label} is on {tensor.device}, tokens on {self.tokens.device}")
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{label} must have shape {expected}, got {tuple(tensor.shape)}")

    def __iter__(self):
        return iter(self.positions)

    def _field(self, label: str) -> torch.Tensor:
        if label.startswith("positions["):
            return self.positions[label[11:-2]]
        if label.startswith("spans["):
            return self.spans[label[7:-2]]
        return getattr(self, label)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """The padded width `L` of `tokens`."""
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles each row names, in order."""
        return tuple(self.positions)

    def span(self, role: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(start (n,), stop (n,)): the tokens role `role` covers in each row."""
        if role in self.spans:
            return self.spans[role][:, 0], self.spans[role][:, 1]
        return self.positions[role], self.positions[role] + 1

    def documents(self) -> torch.Tensor:
        """(n,) the document of each row (0..n-1 when every row is its own)."""
        if self.document is None:
            return torch.arange(len(self), device=self.device)
        return self.document

    @functools.cached_property
    def document_starts(self) -> torch.Tensor:
        """(d + 1,) the first row of each of the d documents, then n: rows starts[j] ..
        starts[j + 1] - 1 are document j's (in order of appearance)."""
        if self.document is None:
            return torch.arange(len(self) + 1, device=self.device)
        new = torch.ones(len(self), dtype=torch.bool, device=self.device)
        new[1:] = self.document[1:] != self.document[:-1]
        first = new.nonzero()[:, 0]
        return torch.cat([first, first.new_tensor([len(self)])])

    @property
    def num_documents(self) -> int:
        return len(self.document_starts) - 1

    def take_documents(self, index: torch.Tensor) -> Batch:
        """The rows of documents `index` (positions into `document_starts`, in that order)."""
        if self.document is None:
            return self[index]
        starts = self.document_starts
        first, count = starts[index], (starts[1:] - starts[:-1])[index]
        offsets = torch.arange(int(count.sum()), device=self.device)
        offsets -= torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
        return self[torch.repeat_interleave(first, count) + offsets]

    def __getitem__(self, index: int | slice | torch.Tensor | Sequence[int] | np.ndarray) -> Batch:
        if isinstance(index, bool):
            raise TypeError("a Batch cannot be indexed by a bool")
        if isinstance(index, np.integer) or (
            isinstance(index, torch.Tensor) and index.dim() == 0 and not index.is_floating_point()
        ):
            index = int(index)
        if isinstance(index, int):
            n = len(self)
            if not -n <= index < n:
                raise IndexError(f"index {index} out of range for a batch of {n}")
            index = slice(index % n, index % n + 1)
        elif not isinstance(index, slice):
            index = torch.as_tensor(index, device=self.device)
            if index.dtype not in (torch.bool, torch.long, torch.int32):
                raise TypeError(f"index tensor must be integer or bool, got {index.dtype}")
        return self._map(lambda tensor: tensor[index])

    def to(self, device: torch.device | str) -> Batch:
        """The same batch with every tensor moved to `device`."""
        return self._map(lambda tensor: tensor.to(device))

    def trim(self) -> Batch:
        """The same rows with trailing all-padding columns removed (width = max length)."""
        width = int(self.lengths.max()) if len(self) else 0
        return self._map(lambda tensor: tensor, width=width)

    def equals(self, other: Batch) -> bool:
        """True when both batches hold the same rows: tokens, answers, roles, lengths,
        documents, spans and targets."""
        mine, theirs = self._tensors(), other._tensors()
        return mine.keys() == theirs.keys() and all(
            mine[k].shape == theirs[k].shape and torch.equal(mine[k], theirs[k]) for k in mine
        )

    def _tensors(self) -> dict[str, torch.Tensor]:
        out = {"tokens": self.tokens, "answers": self.answers, "lengths": self.lengths}
        out |= {f"positions.{role}": t for role, t in self.positions.items()}
        out |= {f"spans.{role}": t for role, t in self.spans.items()}
        if self.document is not None:
            out["document"] = self.document
        if self.targets is not None:
            out["targets"] = self.targets
        return out

    def _map(self, function, width: int | None = None) -> Batch:
        columns = slice(None) if width is None else slice(0, width)
        return Batch(
            tokens=function(self.tokens)[:, columns],
            answers=function(self.answers),
            positions={role: function(t) for role, t in self.positions.items()},
            lengths=function(self.lengths),
            document=None if self.document is None else function(self.document),
            spans={role: function(t) for role, t in self.spans.items()},
            targets=None if self.targets is None else function(self.targets)[:, columns],
        )


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """Stack batches along the row axis, padding each to the widest one; document ids of the
    later batches are shifted past the earlier ones'.

    Args:
        batches: at least one `Batch`, all on the same device, naming the same roles.

    Returns:
        a `Batch` with `sum(len(b) for b in batches)` rows, in order.
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    first = batches[0]
    for batch in batches[1:]:
        if batch.roles != first.roles or set(batch.spans) != set(first.spans):
            raise ValueError(f"concat_batches: roles differ ({first.roles} and {batch.roles})")
        if (batch.document is None) != (first.document is None) or (
            (batch.targets is None) != (first.targets is None)
        ):
            raise ValueError("concat_batches: batches differ in having documents or targets")
    width = max(batch.width for batch in batches)

    def padded(tensors: list[torch.Tensor], value: int) -> torch.Tensor:
        return torch.cat(
            [torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors]
        )

    document = None
    if first.document is not None:
        shifted, offset = [], 0
        for batch in batches:
            shifted.append(batch.document + offset)
            offset += int(batch.document.max()) + 1 if len(batch) else 0
        document = torch.cat(shifted)
    return Batch(
        tokens=padded([b.tokens for b in batches], 0),
        answers=torch.cat([b.answers for b in batches]),
        positions={role: torch.cat([b.positions[role] for b in batches]) for role in first},
        lengths=torch.cat([b.lengths for b in batches]),
        document=document,
        spans={role: torch.cat([b.spans[role] for b in batches]) for role in first.spans},
        targets=None if first.targets is None else padded([b.targets for b in batches], IGNORE),
    )
