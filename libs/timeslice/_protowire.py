"""The protobuf wire format's smallest parts, shared by the strict request decoder
(:mod:`timeslice.wire`) and the status-details codec (:mod:`timeslice.status_details`)."""

from __future__ import annotations

_U64 = 1 << 64


class MalformedMessage(ValueError):
    """The bytes are not a valid encoding of the expected message."""


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """A protobuf varint at ``pos``: its value and the position after it."""
    result = 0
    for shift in range(0, 70, 7):
        if pos >= len(data):
            raise MalformedMessage("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >= _U64:
                raise MalformedMessage("varint does not fit in 64 bits")
            return result, pos
    raise MalformedMessage("varint longer than 10 bytes")
