"""The one integer validator every option, argument and config field goes through."""

from __future__ import annotations

import numpy as np

__all__ = ["NotAnInt", "check_int"]


class NotAnInt(TypeError, ValueError):
    """A value given where an int belongs is not one (bools included): a TypeError, and a
    ValueError too, as every other bad value of an option is."""


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """`value` as an int in [minimum, maximum] (no maximum: None); otherwise one line naming
    `name`: NotAnInt for a value that is not an int, ValueError for one out of bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise NotAnInt(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return int(value)
