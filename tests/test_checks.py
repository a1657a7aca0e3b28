"""mecheval.checks.check_int, the one integer validator: what it accepts and returns, and the
one line it raises otherwise (a NotAnInt, both TypeError and ValueError, for a value that is
not an int; a ValueError naming the bounds for one outside them)."""

from __future__ import annotations

import numpy as np
import pytest

from mecheval.checks import NotAnInt, check_int


@pytest.mark.parametrize(
    "value, minimum, maximum",
    [(3, 1, None), (0, 0, None), (8, 1, 8), (np.int64(5), 1, None), (1, 1, 1)],
)
def test_ints_within_bounds_come_back_as_python_ints(value, minimum, maximum):
    got = check_int("n", value, minimum, maximum)
    assert got == int(value) and type(got) is int


@pytest.mark.parametrize("value", [True, False, 2.0, "3", None, np.float32(1.0), [1]])
def test_a_value_that_is_not_an_int_is_refused_as_both_kinds_of_error(value):
    with pytest.raises(NotAnInt, match=r"^n must be an int, got ") as raised:
        check_int("n", value, 0)
    assert isinstance(raised.value, TypeError) and isinstance(raised.value, ValueError)


@pytest.mark.parametrize(
    "value, minimum, maximum, message",
    [
        (0, 1, None, "d_model must be >= 1, got 0"),
        (-5, 0, None, "d_model must be >= 0, got -5"),
        (9, 1, 8, "d_model must be in 1..8, got 9"),
        (0, 1, 8, "d_model must be in 1..8, got 0"),
    ],
)
def test_an_int_out_of_bounds_names_them(value, minimum, maximum, message):
    with pytest.raises(ValueError) as raised:
        check_int("d_model", value, minimum, maximum)
    assert str(raised.value) == message and not isinstance(raised.value, TypeError)
