"""Identifiers become etcd key parts, metric labels and CLI output: checked before any use."""

from __future__ import annotations

import pytest

from timeslice.errors import InvalidArgument
from timeslice.ids import (
    MAX_ID_LENGTH,
    validate_group_id,
    validate_id,
    validate_job_id,
    validate_node,
)


@pytest.mark.parametrize(
    "value", ["a", "trainer-0", "job.v2", "ns:job_1", "0abc", "x" * MAX_ID_LENGTH]
)
def test_valid_ids_are_returned_unchanged(value: str) -> None:
    assert validate_id(value, "job_id") == value


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "must not be empty"),
        ("x" * (MAX_ID_LENGTH + 1), "the limit is 253"),
        ("a/b", "is not valid"),
        ("a..b", "is not valid"),
        ("-lead", "starting with a letter or digit"),
        (".hidden", "is not valid"),
        ("sp ace", "is not valid"),
        ("naïve", "is not valid"),
        ("new\nline", "is not valid"),
    ],
)
def test_bad_ids_are_refused_with_a_reason(value: str, says: str) -> None:
    with pytest.raises(InvalidArgument, match=says):
        validate_id(value, "group_id")


@pytest.mark.parametrize("value", [None, 3, b"job", ["job"]])
def test_a_non_string_names_its_type(value: object) -> None:
    with pytest.raises(InvalidArgument, match=f"got {type(value).__name__}"):
        validate_id(value, "node")


def test_each_validator_names_what_it_checks() -> None:
    for validator, what in (
        (validate_job_id, "job_id"),
        (validate_group_id, "group_id"),
        (validate_node, "node"),
    ):
        with pytest.raises(InvalidArgument, match=what):
            validator("")
        assert validator("ok") == "ok"
