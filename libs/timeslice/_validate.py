"""Argument checks shared by the clients: they raise :class:`InvalidArgument` before any call."""

from __future__ import annotations

import math

from timeslice.errors import InvalidArgument

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def check_seconds(value: object, what: str, *, allow_none: bool = False) -> float | None:
    """Validate a duration argument: a finite number >= 0 (or ``None`` when allowed)."""
    if value is None:
        if allow_none:
            return None
        raise InvalidArgument(f"{what} must be a number of seconds, got None")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{what} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or math.isinf(seconds) or seconds < 0:
        raise InvalidArgument(f"{what} must be a finite number >= 0, got {value!r}")
    return seconds


def check_positive(value: object, what: str) -> float:
    """Validate a duration that must be > 0 (a TTL, a call timeout)."""
    seconds = check_seconds(value, what)
    assert seconds is not None
    if seconds <= 0:
        raise InvalidArgument(f"{what} must be > 0, got {value!r}")
    return seconds


def check_priority(value: object) -> int:
    """Validate an acquire priority: an int in the wire's int32 range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"priority must be an int, got {type(value).__name__}")
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise InvalidArgument(f"priority {value} is outside the int32 range")
    return value
