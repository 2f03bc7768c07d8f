"""The clients' argument checks: bad durations and priorities fail before any call."""

from __future__ import annotations

import math

import pytest

from timeslice._validate import check_positive, check_priority, check_seconds
from timeslice.errors import InvalidArgument


@pytest.mark.parametrize("value", [0, 0.0, 1, 2.5, 10**6])
def test_seconds_accept_finite_non_negative_numbers(value: float) -> None:
    assert check_seconds(value, "timeout") == float(value)


@pytest.mark.parametrize("value", [-1, -0.001, math.nan, math.inf, -math.inf])
def test_seconds_refuse_negative_and_non_finite(value: float) -> None:
    with pytest.raises(InvalidArgument, match="finite number >= 0"):
        check_seconds(value, "timeout")


@pytest.mark.parametrize("value", [True, "5", b"5", [5]])
def test_seconds_refuse_what_is_not_a_number(value: object) -> None:
    with pytest.raises(InvalidArgument, match="timeout must be a number of seconds"):
        check_seconds(value, "timeout")


def test_none_only_where_allowed() -> None:
    assert check_seconds(None, "timeout", allow_none=True) is None
    with pytest.raises(InvalidArgument, match="got None"):
        check_seconds(None, "timeout")


def test_positive_refuses_zero() -> None:
    assert check_positive(0.5, "ttl") == 0.5
    with pytest.raises(InvalidArgument, match="ttl must be > 0"):
        check_positive(0, "ttl")


@pytest.mark.parametrize("value", [0, -5, 2**31 - 1, -(2**31)])
def test_priority_in_the_int32_range(value: int) -> None:
    assert check_priority(value) == value


@pytest.mark.parametrize(
    ("value", "says"),
    [(2**31, "int32"), (-(2**31) - 1, "int32"), (1.0, "must be an int"), (True, "must be an int")],
)
def test_priority_refused(value: object, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        check_priority(value)
