"""A task of one's own, in one file: successor recall, the classic induction-head probe.

A document is a run of distinct random tokens, a divider, then one of them again; the answer is
the token that followed it in the run. There are no key-value pairs: every token is the key of
its successor. Use it by import path, unchanged through the command line:

    mecheval train --out runs/successor task.name=examples.successor:SuccessorRecall \\
        task.options.length=12 arch=attention
    mecheval evaluate runs/successor && mecheval report runs/successor

docs/tasks.md walks through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from mecheval.checks import check_int
from mecheval.tasks import Batch, Corruption, Task


@dataclass(frozen=True)
class SuccessorRecall(Task):
    """Args:
    length: tokens in the run before the divider.
    num_tokens: the ids a run draws from (distinct within a run).
    """

    length: int = 16
    num_tokens: int = 64
    name: ClassVar[str] = "successor"
    roles: ClassVar[tuple[str, ...]] = ("key", "value", "divider", "query")
    corruptions: ClassVar[dict[str, Corruption]] = {
        "key": Corruption("key"),  # another token where the queried one stood
        "value": Corruption("value"),  # another successor
    }

    def __post_init__(self) -> None:
        check_int("length", self.length, 2)
        check_int("num_tokens", self.num_tokens, self.length + 1)

    @property
    def vocab_size(self) -> int:
        return 3 + self.num_tokens

    @property
    def max_document_length(self) -> int:
        return self.length + 3

    def token_name(self, token: int) -> str:
        return f"t{token - 3}"

    def replacement_range(self, corruption: str) -> tuple[int, int]:
        return 3, self.vocab_size

    def _generate(self, n: int, seed: int, split: str) -> Batch:
        rng = self.task_rng(seed, self.splits.index(split))
        run = 3 + np.argsort(rng.random((n, self.num_tokens)), axis=1)[:, : self.length]
        key = rng.integers(0, self.length - 1, size=n)  # never the last: it has no successor
        rows = np.arange(n)
        tokens = np.concatenate(
            [np.full((n, 1), self.BOS), run, np.full((n, 1), self.EOS), run[rows, key, None]], 1
        )
        key = key + 1  # after BOS
        divider = self.length + 1
        return Batch(
            tokens=torch.from_numpy(tokens),
            answers=torch.from_numpy(tokens[rows, key + 1]),
            positions={
                "key": torch.from_numpy(key),
                "value": torch.from_numpy(key + 1),
                "divider": torch.full((n,), divider),
                "query": torch.full((n,), divider + 1),
            },
            lengths=torch.full((n,), self.length + 3),
        )
