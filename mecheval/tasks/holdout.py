"""Pair-level held-out sets: which (left, right) token pairs only the test split may query.

AR holds out (key, value) pairs and ATR holds out (parent, child) terminal pairs. Both use
`PairHoldout`, whose definition is:

- Pair `(a, b)` with `0 <= a < num_left`, `0 <= b < num_right` has the index
  `i = a * num_right + b` and the score `h(i) = mix64(i + salt)`, where `mix64` is the
  SplitMix64 finaliser, a bijection of the 64-bit integers (so distinct pairs never tie).
- With `N = num_left * num_right` pairs and `m = round(fraction * N)`: when `N <= 2**22`, the
  held-out pairs are exactly the `m` pairs of smallest score (an exact fraction, e.g. 80 of the
  400 pairs of the 20-terminal ATR at 20%); for larger `N` they are the pairs with
  `h(i) < fraction * 2**64`, a pseudo-random subset whose size is within a few `sqrt(N)` of
  `m` (relative error below 0.1% for the AR and 8192-terminal spaces).
- When `m = 0` no pair is held out.

Membership is a vectorised O(1) test per pair; no table of pairs is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

EXACT_SELECTION_MAX_PAIRS = 2**22
"""Pair spaces up to this size hold out exactly round(fraction * N) pairs."""

_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def mix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser applied elementwise.

    Args:
        values: integer array of any shape (taken modulo 2**64).

    Returns:
        `uint64` array of the same shape; a bijection on 64-bit integers.
    """
    z = np.asarray(values).astype(np.uint64, copy=True)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


@dataclass(frozen=True)
class PairHoldout:
    """The held-out subset of the pairs `[0, num_left) x [0, num_right)` (see module docstring).

    Args:
        num_left: number of left items (AR keys, ATR parent terminals).
        num_right: number of right items (AR values, ATR child terminals).
        fraction: share of pairs held out, in `[0, 1)`.
        salt: any integer; different salts give independent subsets.
    """

    num_left: int
    num_right: int
    fraction: float
    salt: int
    threshold: np.uint64 = field(init=False, repr=False, compare=False)
    """Pairs whose score is strictly below this are held out."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"holdout fraction must be in [0, 1), got {self.fraction}")
        num_pairs = self.num_left * self.num_right
        count = round(self.fraction * num_pairs)
        if count == 0:
            threshold = np.uint64(0)
        elif num_pairs <= EXACT_SELECTION_MAX_PAIRS:
            scores = self._scores(np.arange(num_pairs, dtype=np.uint64))
            threshold = np.partition(scores, count - 1)[count - 1] + np.uint64(1)
        else:
            threshold = np.uint64(min(int(self.fraction * 2.0**64), 2**64 - 1))
        object.__setattr__(self, "threshold", threshold)

    @property
    def num_pairs(self) -> int:
        return self.num_left * self.num_right

    def _scores(self, pair_index: np.ndarray) -> np.ndarray:
        offset = np.array([(self.salt * _GOLDEN_GAMMA) % 2**64], dtype=np.uint64)
        return mix64(pair_index.astype(np.uint64) + offset)

    def is_held_out(self, left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """Whether each pair `(left[i], right[i])` is held out.

        Args:
            left: integer array with values in `[0, num_left)`.
            right: integer array of the same shape, values in `[0, num_right)`.

        Returns:
            bool array of that shape.
        """
        left = np.asarray(left, dtype=np.int64)
        right = np.asarray(right, dtype=np.int64)
        index = left.astype(np.uint64) * np.uint64(self.num_right) + right.astype(np.uint64)
        return self._scores(index) < self.threshold

    def held_out_count(self) -> int:
        """How many pairs are held out (counts every pair; meant for small spaces and tests)."""
        total = 0
        for first in range(0, self.num_pairs, 1 << 20):
            index = np.arange(first, min(first + (1 << 20), self.num_pairs), dtype=np.uint64)
            total += int((self._scores(index) < self.threshold).sum())
        return total
