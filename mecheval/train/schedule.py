"""The learning-rate schedule of the study: linear warm-up, then cosine decay to 0."""

from __future__ import annotations

import math


def learning_rate(step: int, total_steps: int, peak: float, warmup_fraction: float) -> float:
    """The learning rate of optimiser step `step` (0-based) of `total_steps`.

    Warm-up rises linearly over the first `warmup_fraction` of the steps, reaching `peak` at
    its last step (step 0 already takes a non-zero step); then a half cosine falls from `peak`
    towards 0, which it would reach at step `total_steps`.
    """
    warmup = int(round(warmup_fraction * total_steps))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total_steps - warmup, 1)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
