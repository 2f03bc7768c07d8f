"""The error table (timeslice.errors): one class per kind, the status each is sent as, and how
a status is read back into a class. The kinds' own encoding in the status details is tested in
tests/unit/test_status_details.py."""

from __future__ import annotations

import pytest
from grpclib.const import Status

from timeslice import errors
from timeslice.errors import (
    CertificateExpired,
    CertificateFileError,
    ConnectionFailed,
    ConnectionRefused,
    ErrorKind,
    InternalError,
    InvalidArgument,
    NotFound,
    ServerRequiresTls,
    Timeout,
    TimeSliceError,
    Unavailable,
    error_from_status,
)


def _kind_classes() -> dict[ErrorKind, list[type[TimeSliceError]]]:
    """The classes that stand for a kind: direct children of TimeSliceError (the rest, such
    as ConnectionRefused, refine one of them)."""
    found: dict[ErrorKind, list[type[TimeSliceError]]] = {}
    for value in vars(errors).values():
        if isinstance(value, type) and issubclass(value, TimeSliceError):
            if TimeSliceError in value.__bases__:
                found.setdefault(value.kind, []).append(value)
    return found


def test_every_kind_has_exactly_one_class_and_comes_back_as_it() -> None:
    classes = _kind_classes()
    assert set(classes) == set(ErrorKind)
    for kind, of_kind in classes.items():
        assert len(of_kind) == 1, f"{kind} has several classes: {of_kind}"
        back = error_from_status(Status.UNKNOWN, "m", kind)
        assert type(back) is of_kind[0]
        assert back.kind is kind


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_an_error_is_sent_with_its_status_and_read_back_by_it(kind: ErrorKind) -> None:
    error = error_from_status(Status.UNKNOWN, "what went wrong", kind)
    sent = error.to_grpc()
    assert (sent.status, sent.message, sent.details) == (error.status, "what went wrong", kind)
    # Read by status alone (no details: another server, a proxy), the code keeps its class
    # family: FAILED_PRECONDITION's three kinds come back as the first, the rest exactly.
    by_code = error_from_status(sent.status, sent.message)
    assert by_code.status is error.status
    assert by_code.message == "what went wrong"


def test_an_api_may_send_a_kind_under_another_status() -> None:
    sent = NotFound("no such group").to_grpc(Status.PERMISSION_DENIED)
    assert sent.status is Status.PERMISSION_DENIED
    assert sent.details is ErrorKind.NOT_FOUND


def test_a_status_no_kind_maps_to_is_internal_and_names_itself_without_text() -> None:
    back = error_from_status(Status.DATA_LOSS, None)
    assert type(back) is InternalError
    assert back.message == "DATA_LOSS"
    assert type(error_from_status(Status.UNKNOWN, "x", details="not a kind")) is InternalError


def test_errors_are_also_the_builtin_errors_callers_already_catch() -> None:
    assert isinstance(InvalidArgument("x"), ValueError)
    assert isinstance(NotFound("x"), LookupError)
    assert isinstance(Timeout("x"), TimeoutError)
    assert isinstance(Unavailable("x"), ConnectionError)


def test_connection_failures_are_outages_and_only_final_when_told() -> None:
    for cls in (ConnectionFailed, ConnectionRefused, ServerRequiresTls, CertificateExpired):
        error = cls("x")
        assert error.kind is ErrorKind.UNAVAILABLE
        assert error.status is Status.UNAVAILABLE
        assert error.final is False
    assert ConnectionRefused("x", final=True).final
    # A certificate file that cannot be read is the caller's input, not an outage.
    assert CertificateFileError("x").kind is ErrorKind.INVALID_ARGUMENT
