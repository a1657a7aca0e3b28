"""PairHoldout: membership against a plain-Python oracle of its documented definition."""

import numpy as np
import pytest

from mecheval.tasks.holdout import EXACT_SELECTION_MAX_PAIRS, PairHoldout, mix64
from tests.tasks.oracles import held_out_pairs_by_rank, pair_score, splitmix64_finaliser


def test_mix64_matches_python_splitmix_and_is_injective_on_a_range():
    values = np.array([0, 1, 2, 12345, 2**63, 2**64 - 1], dtype=np.uint64)
    expected = [splitmix64_finaliser(int(v)) for v in values]
    assert mix64(values).tolist() == expected
    many = mix64(np.arange(100_000, dtype=np.uint64))
    assert len(np.unique(many)) == 100_000


@pytest.mark.parametrize("fraction, salt", [(0.2, 0), (0.2, 7), (0.5, 3), (0.01, 1)])
def test_small_space_holds_out_exactly_the_lowest_scoring_pairs(fraction, salt):
    holdout = PairHoldout(20, 20, fraction, salt)
    expected = held_out_pairs_by_rank(holdout)
    assert len(expected) == round(fraction * 400)
    a, b = np.meshgrid(np.arange(20), np.arange(20), indexing="ij")
    held = holdout.is_held_out(a.ravel(), b.ravel())
    got = {(int(x), int(y)) for x, y, h in zip(a.ravel(), b.ravel(), held, strict=True) if h}
    assert got == expected
    assert holdout.held_out_count() == len(expected)


def test_pair_orientation_matters():
    holdout = PairHoldout(20, 20, 0.2, 0)
    held = {(a, b) for a in range(20) for b in range(20) if holdout.is_held_out(a, b)}
    assert held != {(b, a) for a, b in held}


def test_large_space_uses_the_fraction_threshold_and_is_close_to_the_fraction():
    holdout = PairHoldout(4096, 4096, 0.2, 1)
    assert holdout.num_pairs > EXACT_SELECTION_MAX_PAIRS
    assert int(holdout.threshold) == int(0.2 * 2.0**64)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 4096, 200_000), rng.integers(0, 4096, 200_000)
    held = holdout.is_held_out(a, b)
    oracle = [
        pair_score(holdout, int(x), int(y)) < int(holdout.threshold)
        for x, y in zip(a[:2000], b[:2000], strict=True)
    ]
    assert held[:2000].tolist() == oracle
    standard_error = (0.2 * 0.8 / 200_000) ** 0.5
    assert abs(held.mean() - 0.2) < 5 * standard_error


def test_zero_fraction_holds_nothing_and_bad_fractions_are_refused():
    assert PairHoldout(20, 20, 0.0, 0).held_out_count() == 0
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="fraction"):
            PairHoldout(20, 20, bad, 0)
