"""Typed errors shared by the SDK and the services.

On the wire an error is a gRPC status (a meaningful code for any client, a plain human
message) whose kind travels typed in ``grpc-status-details-bin`` as a ``google.rpc.ErrorInfo``
(:mod:`timeslice.status_details`); both sides map between :class:`ErrorKind` and the exception
classes below, so our SDK raises the precise exception. A status without that detail (another
server, a proxy) is classed by its code alone.
"""

from __future__ import annotations

import enum

from grpclib.const import Status
from grpclib.exceptions import GRPCError


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

    def to_grpc(self, status: Status | None = None) -> GRPCError:
        """This error as a server raises it: its status (or ``status``, for an API that
        maps kinds its own way), its plain message, and its kind as the status details."""
        return GRPCError(status or self.status, self.message, self.kind)


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


class ConnectionFailed(Unavailable):
    """A connection to a server could not be made, or the server ended it before answering.

    The subclasses name the cause; the message names the address and what to do. Retried
    as any outage (a server restarting, a rotation in progress) unless ``final``: nothing a
    retry can change (the call then fails at once).
    """

    def __init__(self, message: str, *, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


class ConnectionRefused(ConnectionFailed):
    """Nothing listens on the address (connection refused): the server is not running
    there, or the address (host, port) is wrong."""


class NameNotResolved(ConnectionFailed):
    """The host name of the address does not resolve (DNS): a typo, or a name only known
    inside another network (a Kubernetes service name outside the cluster)."""


class TlsRefused(ConnectionFailed):
    """The connection failed at the TLS level: a handshake failed, or the server refused
    our certificate. The message says which, and why when the alert tells."""


class TlsMismatch(TlsRefused):
    """One side speaks TLS and the other plaintext."""


class ServerWithoutTls(TlsMismatch):
    """This client speaks TLS; the server answers plaintext (started with ``--insecure``)."""


class ServerRequiresTls(TlsMismatch):
    """This client speaks plaintext; the server speaks TLS and hung up on it."""


class UntrustedCertificate(TlsRefused):
    """A certificate is not signed by a CA the other side trusts: the server's, by the CA
    this client was given, or ours, by the server's CA (two different deployments' CAs)."""


class CertificateExpired(TlsRefused):
    """A certificate (the server's or ours) is past its end of validity: renew it."""


class CertificateFileError(InvalidArgument):
    """A TLS file (CA, certificate or key) is missing, unreadable or not PEM; the message
    names the path. A configuration error: raised when the client is built or first
    connects, never retried."""


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


def error_from_status(
    status: Status, message: str | None, details: object = None
) -> TimeSliceError:
    """Rebuild the typed error a server sent as a gRPC status.

    ``details`` is what :class:`~timeslice.status_details.KindDetailsCodec` decoded from the
    status details (the kind); without it the status code decides the class.
    """
    text = message or status.name
    kind = details if isinstance(details, ErrorKind) else None
    if kind is None:
        kind = _BY_STATUS.get(status, ErrorKind.INTERNAL)
    return _BY_KIND[kind](text)
