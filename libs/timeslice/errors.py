"""Typed errors shared by the SDK and the services.

On the wire an error is a gRPC status whose message starts with ``[kind]``; both sides map
between :class:`ErrorKind` and the exception classes below, so a plain grpcio client still sees
a meaningful status code and our SDK raises the precise exception.
"""

from __future__ import annotations

import enum
import re

from grpclib.const import Status


class ErrorKind(enum.Enum):
    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    PERMISSION_DENIED = "permission_denied"
    UNAUTHENTICATED = "unauthenticated"
    ALREADY_EXISTS = "already_exists"
    NOT_HOLDER = "not_holder"
    FAILED_PRECONDITION = "failed_precondition"
    SESSION_EXPIRED = "session_expired"
    GROUP_FAULTED = "group_faulted"
    TIMEOUT = "timeout"
    UNAVAILABLE = "unavailable"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


_STATUS: dict[ErrorKind, Status] = {
    ErrorKind.INVALID_ARGUMENT: Status.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: Status.NOT_FOUND,
    ErrorKind.RESOURCE_EXHAUSTED: Status.RESOURCE_EXHAUSTED,
    ErrorKind.PERMISSION_DENIED: Status.PERMISSION_DENIED,
    ErrorKind.UNAUTHENTICATED: Status.UNAUTHENTICATED,
    ErrorKind.ALREADY_EXISTS: Status.ALREADY_EXISTS,
    ErrorKind.NOT_HOLDER: Status.FAILED_PRECONDITION,
    ErrorKind.FAILED_PRECONDITION: Status.FAILED_PRECONDITION,
    ErrorKind.SESSION_EXPIRED: Status.FAILED_PRECONDITION,
    ErrorKind.GROUP_FAULTED: Status.ABORTED,
    ErrorKind.TIMEOUT: Status.DEADLINE_EXCEEDED,
    ErrorKind.UNAVAILABLE: Status.UNAVAILABLE,
    ErrorKind.CANCELLED: Status.CANCELLED,
    ErrorKind.INTERNAL: Status.INTERNAL,
}


class TimeSliceError(Exception):
    """Base of every error the SDK raises."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def status(self) -> Status:
        return _STATUS[self.kind]

    def wire_message(self) -> str:
        return f"[{self.kind.value}] {self.message}"


class InvalidArgument(TimeSliceError, ValueError):
    """An ID or parameter is malformed; nothing was changed."""

    kind = ErrorKind.INVALID_ARGUMENT


class NotFound(TimeSliceError, LookupError):
    """The group or session does not exist."""

    kind = ErrorKind.NOT_FOUND


class ResourceExhausted(TimeSliceError):
    """A quota or limit was reached (groups, sessions, queue entries, message size); the
    message names the limit. Nothing was changed."""

    kind = ErrorKind.RESOURCE_EXHAUSTED


class PermissionDenied(TimeSliceError):
    """The caller may not do this (for example yield a group another job holds)."""

    kind = ErrorKind.PERMISSION_DENIED


class Unauthenticated(TimeSliceError):
    """The call did not prove who it acts for: a session's secret was missing or wrong."""

    kind = ErrorKind.UNAUTHENTICATED


class AlreadyExists(TimeSliceError):
    """The job already waits for or holds the group (acquire twice)."""

    kind = ErrorKind.ALREADY_EXISTS


class NotHolder(TimeSliceError):
    """The job does not hold the group under that epoch (yield twice, stale epoch)."""

    kind = ErrorKind.NOT_HOLDER


class FailedPrecondition(TimeSliceError):
    """The request is well formed but the cluster is not in a state to accept it (for
    example pinning a node whose agent never connected); it may succeed once that changes."""

    kind = ErrorKind.FAILED_PRECONDITION


class SessionExpired(TimeSliceError):
    """The session's lease is gone; everything it held was released."""

    kind = ErrorKind.SESSION_EXPIRED


class GroupFaulted(TimeSliceError):
    """A context switch for this job failed; the reason says where."""

    kind = ErrorKind.GROUP_FAULTED


class Timeout(TimeSliceError, TimeoutError):
    """A deadline passed before the call completed."""

    kind = ErrorKind.TIMEOUT


class Unavailable(TimeSliceError, ConnectionError):
    """No orchestrator replica (or etcd behind it) could be reached."""

    kind = ErrorKind.UNAVAILABLE


class Cancelled(TimeSliceError):
    kind = ErrorKind.CANCELLED


class InternalError(TimeSliceError):
    kind = ErrorKind.INTERNAL


_BY_KIND: dict[ErrorKind, type[TimeSliceError]] = {
    cls.kind: cls
    for cls in (
        InvalidArgument,
        NotFound,
        ResourceExhausted,
        PermissionDenied,
        Unauthenticated,
        AlreadyExists,
        NotHolder,
        FailedPrecondition,
        SessionExpired,
        GroupFaulted,
        Timeout,
        Unavailable,
        Cancelled,
        InternalError,
    )
}

_BY_STATUS: dict[Status, ErrorKind] = {
    Status.INVALID_ARGUMENT: ErrorKind.INVALID_ARGUMENT,
    Status.NOT_FOUND: ErrorKind.NOT_FOUND,
    Status.RESOURCE_EXHAUSTED: ErrorKind.RESOURCE_EXHAUSTED,
    Status.PERMISSION_DENIED: ErrorKind.PERMISSION_DENIED,
    Status.UNAUTHENTICATED: ErrorKind.UNAUTHENTICATED,
    Status.ALREADY_EXISTS: ErrorKind.ALREADY_EXISTS,
    Status.FAILED_PRECONDITION: ErrorKind.NOT_HOLDER,
    Status.ABORTED: ErrorKind.GROUP_FAULTED,
    Status.DEADLINE_EXCEEDED: ErrorKind.TIMEOUT,
    Status.UNAVAILABLE: ErrorKind.UNAVAILABLE,
    Status.CANCELLED: ErrorKind.CANCELLED,
}

_PREFIX = re.compile(r"^\[([a-z_]+)\] ?(.*)$", re.DOTALL)


def error_from_status(status: Status, message: str | None) -> TimeSliceError:
    """Rebuild the typed error a server sent as a gRPC status."""
    text = message or status.name
    match = _PREFIX.match(text)
    if match:
        try:
            kind = ErrorKind(match.group(1))
            return _BY_KIND[kind](match.group(2))
        except ValueError:
            pass
    return _BY_KIND[_BY_STATUS.get(status, ErrorKind.INTERNAL)](text)
