"""The error kind on the wire: ``grpc-status-details-bin`` with a ``google.rpc.ErrorInfo``.

Every typed error leaves a server as a gRPC status (its code, a plain human message) and,
in the trailer ``grpc-status-details-bin``, a ``google.rpc.Status`` whose one detail is a
``google.rpc.ErrorInfo`` with ``reason`` the :class:`~timeslice.errors.ErrorKind`'s name
(``NOT_HOLDER``) and ``domain`` :data:`DOMAIN`. That is the standard rich error model, so any
gRPC client (grpcio with ``grpc_status``, Go's ``status.FromError``) reads the kind too.

The two messages are encoded here by hand rather than generated: ``google.rpc.Status``
carries its details as ``google.protobuf.Any``, which betterproto2 packs through a message
pool, and we need one fixed detail of three fields. The encoding is the plain protobuf wire
format (checked against Google's own classes in ``tests/unit/test_status_details.py``).

:class:`KindDetailsCodec` plugs into grpclib (``Server(status_details_codec=...)``,
``Channel(status_details_codec=...)``): servers raise ``GRPCError(status, message, kind)``
(:meth:`TimeSliceError.to_grpc`), clients get the kind back as ``GRPCError.details``.
Decoding never raises: a trailer that is malformed, from another domain or names a kind this
version does not know decodes to ``None``, and the status code decides the class.
"""

from __future__ import annotations

from grpclib.const import Status
from grpclib.encoding.base import StatusDetailsCodecBase

from timeslice._protowire import MalformedMessage, read_varint
from timeslice.errors import ErrorKind

__all__ = ["DOMAIN", "ERROR_INFO_TYPE_URL", "KIND_CODEC", "KindDetailsCodec", "decode", "encode"]

DOMAIN = "timeslice.dev"
"""``ErrorInfo.domain`` of our errors: a reason from any other domain is not one of ours."""

ERROR_INFO_TYPE_URL = "type.googleapis.com/google.rpc.ErrorInfo"

_VARINT, _LEN = 0, 2


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, body: bytes) -> bytes:
    return _varint(number << 3 | _LEN) + _varint(len(body)) + body


def encode(status: Status, message: str | None, kind: ErrorKind) -> bytes:
    """``google.rpc.Status{code, message, details: [Any(ErrorInfo{reason, domain})]}``."""
    info = _field(1, kind.name.encode()) + _field(2, DOMAIN.encode())
    detail = _field(1, ERROR_INFO_TYPE_URL.encode()) + _field(2, info)
    out = bytearray()
    if status.value:
        out += _varint(1 << 3 | _VARINT) + _varint(status.value)
    if message:
        out += _field(2, message.encode())
    out += _field(3, detail)
    return bytes(out)


def _fields(data: bytes) -> list[tuple[int, bytes]]:
    """The length-delimited fields of ``data`` (number, body); others are skipped."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(data):
        tag, pos = read_varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if wire == _VARINT:
            _, pos = read_varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == _LEN:
            length, pos = read_varint(data, pos)
            if pos + length > len(data):
                raise MalformedMessage("truncated field")
            out.append((number, data[pos : pos + length]))
            pos += length
        else:
            raise MalformedMessage(f"wire type {wire}")
        if pos > len(data):
            raise MalformedMessage("truncated field")
    return out


def decode(data: bytes) -> ErrorKind | None:
    """The kind in a ``google.rpc.Status``'s ErrorInfo of our domain, or ``None``."""
    try:
        for number, detail in _fields(data):
            if number != 3:
                continue
            any_fields = _fields(detail)
            type_url = b"".join(body for n, body in any_fields if n == 1)
            if type_url.decode() != ERROR_INFO_TYPE_URL:
                continue
            info = dict(_fields(b"".join(body for n, body in any_fields if n == 2)))
            if info.get(2, b"").decode() != DOMAIN:
                continue
            try:
                return ErrorKind[info.get(1, b"").decode()]
            except KeyError:  # a kind from a newer version: the status code decides
                return None
    except (MalformedMessage, UnicodeDecodeError):
        return None
    return None


class KindDetailsCodec(StatusDetailsCodecBase):
    """grpclib's status details codec for an :class:`ErrorKind` (see the module doc)."""

    def encode(self, status: Status, message: str | None, details: object) -> bytes:
        if not isinstance(details, ErrorKind):
            raise TypeError(f"status details must be an ErrorKind, not {type(details).__name__}")
        return encode(status, message, details)

    def decode(self, status: Status, message: str | None, data: bytes) -> ErrorKind | None:
        return decode(data)


KIND_CODEC = KindDetailsCodec()
"""The one codec instance servers and channels share (it holds no state)."""
