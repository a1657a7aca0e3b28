"""The learning-rate schedules against transformers' formulas (which the study calls):
lambda(s) = s / W during warm-up; then 0.5 (1 + cos(pi p)) or (T - s) / (T - W), with
p = (s - W) / (T - W) and W = int(0.1 T)."""

import math

import pytest

from mecheval.train.schedule import learning_rate, warmup_steps


def transformers_lambda(step: int, total: int, warmup: int, schedule: str) -> float:
    if step < warmup:
        return step / max(1, warmup)
    if schedule == "linear":
        return max(0.0, (total - step) / max(1, total - warmup))
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 2.0 * 0.5 * progress)))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
@pytest.mark.parametrize("total", [1000, 50_016, 37])
def test_schedule_equals_transformers(schedule, total):
    peak = 3e-3
    warmup = int(total * 0.1)
    for step in sorted({0, 1, warmup - 1, warmup, warmup + 1, total // 2, total - 1, total}):
        expected = peak * transformers_lambda(step, total, warmup, schedule)
        assert learning_rate(step, total, peak, 0.1, schedule) == pytest.approx(expected, abs=1e-15)


def test_warmup_starts_at_zero_and_lasts_int_of_a_tenth():
    assert warmup_steps(50_016, 0.1) == 5001  # truncated, not rounded
    assert warmup_steps(37, 0.1) == 3
    assert learning_rate(0, 50_016, 1e-3, 0.1) == 0.0
    lrs = [learning_rate(s, 1000, 1.0, 0.1) for s in range(101)]
    assert all(b - a == pytest.approx(0.01) for a, b in zip(lrs, lrs[1:], strict=False))
    assert lrs[100] == pytest.approx(1.0)


def test_decays_reach_zero_at_the_end():
    for schedule in ("cosine", "linear"):
        after = [learning_rate(s, 1000, 1.0, 0.1, schedule) for s in range(100, 1001)]
        assert after[0] == pytest.approx(1.0)
        assert all(b < a for a, b in zip(after, after[1:], strict=False))
        assert after[-1] == pytest.approx(0.0)
    assert learning_rate(550, 1000, 1.0, 0.1, "linear") == pytest.approx(0.5)
    assert learning_rate(550, 1000, 1.0, 0.1, "cosine") == pytest.approx(0.5)


def test_no_warmup_and_bad_schedule():
    assert learning_rate(0, 10, 2.0, 0.0) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="schedule"):
        learning_rate(0, 10, 2.0, 0.1, "step")
