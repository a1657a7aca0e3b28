"""The learning-rate schedule: linear warm-up to the peak, then a half cosine towards 0."""

import math

import pytest

from mecheval.train.schedule import learning_rate


def test_warmup_is_linear_and_reaches_the_peak():
    total, peak = 1000, 3e-3
    lrs = [learning_rate(s, total, peak, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(peak / 100)
    assert all(b - a == pytest.approx(peak / 100) for a, b in zip(lrs, lrs[1:], strict=False))
    assert lrs[-1] == pytest.approx(peak)


def test_cosine_decay_after_warmup_falls_to_zero():
    total, peak = 1000, 1.0
    after = [learning_rate(s, total, peak, 0.1) for s in range(100, total)]
    assert after[0] == pytest.approx(peak)
    assert all(b < a for a, b in zip(after, after[1:], strict=False))  # strictly decreasing
    mid = learning_rate(100 + 450, total, peak, 0.1)
    assert mid == pytest.approx(0.5)  # half way through the decay: cos(pi / 2)
    assert 0 < after[-1] < 1e-4
    assert learning_rate(total, total, peak, 0.1) == pytest.approx(0.0)
    expected = 0.5 * (1 + math.cos(math.pi * 0.25))
    assert learning_rate(100 + 225, total, peak, 0.1) == pytest.approx(expected)


def test_no_warmup():
    assert learning_rate(0, 10, 2.0, 0.0) == pytest.approx(2.0)
