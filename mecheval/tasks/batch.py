"""`Batch`: a set of task documents with their answers and named positions.

Every task returns its documents as one `Batch`. Training slices it into minibatches, the
interventions read its named positions (docs/study.md) and corrupt copies of its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

POSITION_NAMES: tuple[str, ...] = ("key", "value", "divider", "query", "answer")
"""The named positions every task records, in this order (docs/study.md)."""


@dataclass(frozen=True)
class Batch:
    """Documents of one task, right-padded, with the answer and the named positions of each.

    Attributes:
        tokens: `LongTensor (n, L)`, the documents right-padded with `PAD` (id 0) to a common
            width `L`.
        answers: `LongTensor (n,)`, the token to predict at the query position of each document
            (equal to `tokens[i, positions["answer"][i]]`).
        positions: dict from each name in `POSITION_NAMES` to a `LongTensor (n,)` of column
            indices into `tokens`: `key` (in-context position of the queried item), `value`
            (in-context position of its partner), `divider` (the EOS before the query), `query`
            and `answer`.
        lengths: `LongTensor (n,)`, the unpadded length of each document.

    Indexing (`batch[3]`, `batch[2:10]`, `batch[index_tensor]`, `batch[bool_mask]`) selects
    documents and returns a `Batch`; an integer index gives a batch of one document. Indexing
    keeps the width `L`; `trim()` drops padding columns that no selected document uses.
    """

    tokens: torch.Tensor
    answers: torch.Tensor
    positions: dict[str, torch.Tensor]
    lengths: torch.Tensor

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be 2-D (n, L), got shape {tuple(self.tokens.shape)}")
        n = self.tokens.shape[0]
        if set(self.positions) != set(POSITION_NAMES):
            got = sorted(self.positions)
            raise ValueError(f"positions must have exactly the keys {POSITION_NAMES}, got {got}")
        named = {"answers": self.answers, "lengths": self.lengths} | {
            f"positions[{name!r}]": self.positions[name] for name in POSITION_NAMES
        }
        for label, tensor in [("tokens", self.tokens), *named.items()]:
            if tensor.dtype != torch.long:
                raise TypeError(f"{label} must be int64 (LongTensor), got {tensor.dtype}")
            if tensor.device != self.tokens.device:
                raise ValueError(f"{label} is on {tensor.device}, tokens on {self.tokens.device}")
        for label, tensor in named.items():
            if tuple(tensor.shape) != (n,):
                raise ValueError(f"{label} must have shape ({n},), got {tuple(tensor.shape)}")

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """The padded width `L` of `tokens`."""
        return self.tokens.shape[1]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

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
        """The same documents with trailing all-padding columns removed (width = max length)."""
        width = int(self.lengths.max()) if len(self) else 0
        return Batch(self.tokens[:, :width], self.answers, dict(self.positions), self.lengths)

    def equals(self, other: Batch) -> bool:
        """True when both batches hold the same documents, answers, positions and lengths."""
        return (
            self.tokens.shape == other.tokens.shape
            and torch.equal(self.tokens, other.tokens)
            and torch.equal(self.answers, other.answers)
            and torch.equal(self.lengths, other.lengths)
            and all(torch.equal(self.positions[k], other.positions[k]) for k in POSITION_NAMES)
        )

    def _map(self, function) -> Batch:
        return Batch(
            tokens=function(self.tokens),
            answers=function(self.answers),
            positions={name: function(self.positions[name]) for name in POSITION_NAMES},
            lengths=function(self.lengths),
        )


def concat_batches(batches: Sequence[Batch]) -> Batch:
    """Stack batches along the document axis, padding each to the widest one.

    Args:
        batches: at least one `Batch`, all on the same device.

    Returns:
        a `Batch` with `sum(len(b) for b in batches)` documents, in order.
    """
    if not batches:
        raise ValueError("concat_batches needs at least one batch")
    width = max(batch.width for batch in batches)
    padded = [torch.nn.functional.pad(batch.tokens, (0, width - batch.width)) for batch in batches]
    return Batch(
        tokens=torch.cat(padded),
        answers=torch.cat([batch.answers for batch in batches]),
        positions={
            name: torch.cat([batch.positions[name] for batch in batches]) for name in POSITION_NAMES
        },
        lengths=torch.cat([batch.lengths for batch in batches]),
    )
