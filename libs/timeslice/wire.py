"""What the services' gRPC servers accept off the wire: a size limit and strict decoding.

grpclib decodes a request before any handler runs, with betterproto2, which is lenient: a
truncated field reads short, varints are masked to the field's width (``ttl_seconds =
2**32 + 5`` becomes 5, ``client_pid = -1`` becomes 4294967295), and invalid UTF-8 raises a
bare ``UnicodeDecodeError`` that grpclib answers UNKNOWN with a traceback in the log. So the
servers use :class:`StrictProtoCodec`, which walks the message against its schema before
betterproto2 parses it and refuses, typed and before anything is written:

- a message larger than the limit: RESOURCE_EXHAUSTED, with the limit in the message;
- malformed wire data (a truncated field, a bad tag, group wire types, a varint longer
  than 64 bits), a field of the wrong wire type, invalid UTF-8 in a string, a number out of
  its field's range, an enum value the schema does not name, nesting deeper than
  :data:`MAX_DEPTH`: INVALID_ARGUMENT.

Unknown fields are still skipped (after the same structural checks), so an older server
keeps serving a newer client.

:func:`bound_server` adds what the codec cannot see, because grpclib buffers the whole gRPC
frame before decoding it: it reads each frame's 5-byte header and refuses a declared length
over the limit before a byte of the body is buffered (HTTP/2 flow control then holds the
sender back), refuses compressed frames (compression is not negotiated), and answers a
frame cut short by the end of the stream with INVALID_ARGUMENT instead of grpclib's
AssertionError (UNKNOWN, with a traceback).
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import Any

import betterproto2
from grpclib.encoding.proto import ProtoCodec
from grpclib.events import RecvRequest, listen
from grpclib.exceptions import GRPCError
from grpclib.server import Server

from timeslice._protowire import MalformedMessage as MalformedMessage  # re-exported
from timeslice._protowire import read_varint
from timeslice.errors import InvalidArgument, ResourceExhausted
from timeslice.status_details import KIND_CODEC

DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 32

_U32 = 1 << 32
_U64 = 1 << 64
_I32_NEGATIVE = _U64 - (1 << 31)  # the smallest 64-bit encoding of a negative int32
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5
_VARINT_TYPES = {
    betterproto2.TYPE_ENUM,
    betterproto2.TYPE_BOOL,
    betterproto2.TYPE_INT32,
    betterproto2.TYPE_INT64,
    betterproto2.TYPE_UINT32,
    betterproto2.TYPE_UINT64,
    betterproto2.TYPE_SINT32,
    betterproto2.TYPE_SINT64,
}
_FIXED32_TYPES = {betterproto2.TYPE_FLOAT, betterproto2.TYPE_FIXED32, betterproto2.TYPE_SFIXED32}
_FIXED64_TYPES = {betterproto2.TYPE_DOUBLE, betterproto2.TYPE_FIXED64, betterproto2.TYPE_SFIXED64}


def _check_varint(value: int, meta: betterproto2.FieldMetadata, owner: type, name: str) -> None:
    kind = meta.proto_type
    if kind == betterproto2.TYPE_UINT32 and value >= _U32:
        raise MalformedMessage(f"{name} = {value} is out of the uint32 range")
    if kind in (betterproto2.TYPE_INT32, betterproto2.TYPE_ENUM):
        if (1 << 31) <= value < _I32_NEGATIVE:
            raise MalformedMessage(f"{name} = {value} is out of the int32 range")
    if kind == betterproto2.TYPE_SINT32 and value >= _U32:
        raise MalformedMessage(f"{name} is out of the sint32 range")
    if kind == betterproto2.TYPE_BOOL and value > 1:
        raise MalformedMessage(f"{name} = {value} is not a bool (0 or 1)")
    if kind == betterproto2.TYPE_ENUM:
        signed = value - _U64 if value >= _I32_NEGATIVE else value
        # betterproto2's enums are open (an unknown value becomes a pseudo-member), so the
        # schema's own members are the reference.
        enum_cls = owner._betterproto.cls_by_field[name]  # type: ignore[attr-defined]
        if signed not in {member.value for member in enum_cls}:
            raise MalformedMessage(f"{name} = {signed} is not a known value")


def validate(data: bytes, message_type: type, depth: int = 0) -> None:
    """Raise :class:`MalformedMessage` unless ``data`` is a strict encoding of the type."""
    if depth > MAX_DEPTH:
        raise MalformedMessage(f"messages nested deeper than {MAX_DEPTH}")
    meta_cls = message_type._betterproto  # type: ignore[attr-defined]
    pos, end = 0, len(data)
    while pos < end:
        tag, pos = read_varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if number < 1 or number > (1 << 29) - 1:
            raise MalformedMessage(f"field number {number} is out of range")
        if wire == _VARINT:
            value, pos = read_varint(data, pos)
            body = b""
        elif wire in (_FIXED64, _FIXED32):
            size = 8 if wire == _FIXED64 else 4
            if end - pos < size:
                raise MalformedMessage(f"field {number} is truncated")
            body, pos, value = data[pos : pos + size], pos + size, 0
        elif wire == _LEN:
            length, pos = read_varint(data, pos)
            if length > end - pos:
                raise MalformedMessage(
                    f"field {number} claims {length} bytes; {end - pos} are left (truncated)"
                )
            body, pos, value = data[pos : pos + length], pos + length, 0
        else:
            raise MalformedMessage(f"field {number} has wire type {wire} (not supported)")
        name = meta_cls.field_name_by_number.get(number)
        if name is None:
            continue  # unknown: skipped, as every protobuf parser does
        _check_field(meta_cls.meta_by_field_name[name], message_type, name, wire, value, body)
        if wire == _LEN:
            _check_len_field(meta_cls, message_type, name, body, depth)


def _check_field(
    meta: betterproto2.FieldMetadata, owner: type, name: str, wire: int, value: int, body: bytes
) -> None:
    kind = meta.proto_type
    packed = wire == _LEN and bool(meta.repeated) and kind in betterproto2.PACKED_TYPES
    if kind in _VARINT_TYPES:
        if packed:
            pos = 0
            while pos < len(body):
                item, pos = read_varint(body, pos)
                _check_varint(item, meta, owner, name)
        elif wire == _VARINT:
            _check_varint(value, meta, owner, name)
        else:
            raise MalformedMessage(f"{name} has the wrong wire type {wire}")
    elif kind in _FIXED32_TYPES or kind in _FIXED64_TYPES:
        size = 4 if kind in _FIXED32_TYPES else 8
        expected = _FIXED32 if size == 4 else _FIXED64
        if packed:
            if len(body) % size:
                raise MalformedMessage(f"packed {name} is not a whole number of items")
        elif wire != expected:
            raise MalformedMessage(f"{name} has the wrong wire type {wire}")
    elif wire != _LEN:
        raise MalformedMessage(f"{name} has the wrong wire type {wire}")


def _check_len_field(meta_cls: Any, owner: type, name: str, body: bytes, depth: int) -> None:
    meta = meta_cls.meta_by_field_name[name]
    kind = meta.proto_type
    if kind == betterproto2.TYPE_STRING:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise MalformedMessage(f"{name} is not valid UTF-8 ({exc.reason})") from None
    elif kind == betterproto2.TYPE_MESSAGE:
        nested = meta.unwrap() if meta.unwrap else meta_cls.cls_by_field[name]
        validate(body, nested, depth + 1)
    elif kind == betterproto2.TYPE_MAP:
        validate(body, meta_cls.cls_by_field[name], depth + 1)


def _resource_exhausted(message: str) -> GRPCError:
    return ResourceExhausted(message).to_grpc()


def _invalid(message: str) -> GRPCError:
    return InvalidArgument(message).to_grpc()


class StrictProtoCodec(ProtoCodec):
    """grpclib's protobuf codec, refusing oversized and malformed requests (typed)."""

    def __init__(self, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        if max_message_bytes < 1:
            raise ValueError("max_message_bytes must be positive")
        self.max_message_bytes = max_message_bytes

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > self.max_message_bytes:
            raise _resource_exhausted(
                f"message of {len(data)} bytes; the limit is {self.max_message_bytes}"
            )
        try:
            validate(data, message_type)
        except MalformedMessage as exc:
            raise _invalid(f"malformed {message_type.__name__}: {exc}") from None
        try:
            return message_type.FromString(data)
        except Exception as exc:  # what validate missed still answers typed
            raise _invalid(f"malformed {message_type.__name__}: {exc}") from None


_HEADER = struct.Struct(">?I")


def _bounded_recv(
    recv_data: Callable[[int], Awaitable[bytes]], limit: int
) -> Callable[[int], Awaitable[bytes]]:
    """``recv_data`` of one HTTP/2 stream, checking each gRPC frame header it hands out.

    grpclib reads a frame as ``recv_data(5)`` (flag and length) then ``recv_data(length)``;
    the two alternate, so a header read is the call after a body read.
    """
    header_next = True

    async def recv(size: int) -> bytes:
        nonlocal header_next
        reading_header, header_next = header_next, not header_next
        try:
            data = await recv_data(size)
        except AssertionError:  # grpclib: the stream ended inside a frame
            raise _invalid("truncated gRPC frame: the stream ended inside a message") from None
        if not reading_header and len(data) < size:  # grpclib would assert on it
            raise _invalid("truncated gRPC frame: the stream ended inside a message")
        if reading_header and len(data) == _HEADER.size:
            compressed, length = _HEADER.unpack(data)
            if compressed:
                raise _invalid("compressed messages are not supported")
            if length > limit:
                raise _resource_exhausted(f"message of {length} bytes; the limit is {limit}")
        return data

    return recv


def bound_server(server: Server, max_message_bytes: int) -> Server:
    """Refuse oversized, compressed or cut-short frames on every stream of ``server``."""

    async def on_request(event: RecvRequest) -> None:
        handler = event.method_func

        async def bounded(stream: Any) -> None:
            # grpclib 0.4.9 (pinned) has no receive limit: its Stream reads frames through
            # the protocol stream's ``recv_data``, wrapped here for this one stream.
            h2_stream = stream._stream
            h2_stream.recv_data = _bounded_recv(h2_stream.recv_data, max_message_bytes)
            await handler(stream)

        event.method_func = bounded

    listen(server, RecvRequest, on_request)
    return server


def strict_server(
    handlers: list[Any], max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> Server:
    """A grpclib server for ``handlers`` with the strict codec, the frame bound, and the
    error kind sent as status details (:mod:`timeslice.status_details`)."""
    server = Server(
        handlers, codec=StrictProtoCodec(max_message_bytes), status_details_codec=KIND_CODEC
    )
    return bound_server(server, max_message_bytes)
