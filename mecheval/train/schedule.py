"""The learning-rate schedules of the study: linear warm-up from 0, then cosine or linear decay
to 0, as transformers' `get_cosine_schedule_with_warmup` / `get_linear_schedule_with_warmup`
compute them (the study's AR and ATR grids decay with a cosine, its generalisation grids
linearly)."""

from __future__ import annotations

import math
from typing import Literal

Schedule = Literal["cosine", "linear"]
SCHEDULES: tuple[str, ...] = ("cosine", "linear")


def warmup_steps(total_steps: int, warmup_fraction: float) -> int:
    """int(warmup_fraction * total_steps), truncated as the study computes it."""
    return int(total_steps * warmup_fraction)


def learning_rate(
    step: int,
    total_steps: int,
    peak: float,
    warmup_fraction: float,
    schedule: Schedule = "cosine",
) -> float:
    """The learning rate of optimiser step `step` (0-based) of `total_steps`.

    Warm-up: for the first W = int(warmup_fraction * total_steps) steps the rate is
    peak * step / W, so step 0 takes no step at all, as in the study. Then it decays from
    `peak` at step W towards 0 at step `total_steps`: a half cosine, or a straight line.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    warmup = warmup_steps(total_steps, warmup_fraction)
    if step < warmup:
        return peak * step / warmup
    progress = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
    if schedule == "linear":
        return peak * (1.0 - progress)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
