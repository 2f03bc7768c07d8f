"""Validation of job, group and node identifiers.

IDs become parts of etcd keys and appear in logs, metrics labels and CLIs, so they are checked
before anything uses them: 1 to 253 printable ASCII characters from a safe set, starting with a
letter or digit, never containing a path separator or `..`.
"""

from __future__ import annotations

import re

from timeslice.errors import InvalidArgument

MAX_ID_LENGTH = 253
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")


def validate_id(value: object, what: str) -> str:
    """Return ``value`` if it is a valid identifier, else raise :class:`InvalidArgument`."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{what} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(f"{what} must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidArgument(
            f"{what} is {len(value)} characters long; the limit is {MAX_ID_LENGTH}"
        )
    if ".." in value or not _ID_PATTERN.fullmatch(value):
        raise InvalidArgument(
            f"{what} {value!r} is not valid: use letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit"
        )
    return value


def validate_job_id(value: object) -> str:
    return validate_id(value, "job_id")


def validate_group_id(value: object) -> str:
    return validate_id(value, "group_id")


def validate_node(value: object) -> str:
    return validate_id(value, "node")
