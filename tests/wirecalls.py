"""Raw gRPC calls for tests that must choose every byte on the wire.

The stubs encode well-formed messages only; these calls send any bytes (a whole gRPC frame,
a frame whose declared length is a lie, a header alone) over a real HTTP/2 channel, and
report what the server answered: its status, message and any replies (raw bytes).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass, field
from typing import Any

from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.encoding.base import CodecBase
from grpclib.exceptions import GRPCError, StreamTerminatedError

from tests.tlsenv import env_context
from timeslice.errors import ErrorKind
from timeslice.status_details import KIND_CODEC

# Typed answers: every refusal maps to an error kind of timeslice.errors; OK counts too.
TYPED = {
    Status.OK,
    Status.INVALID_ARGUMENT,
    Status.NOT_FOUND,
    Status.PERMISSION_DENIED,
    Status.ALREADY_EXISTS,
    Status.FAILED_PRECONDITION,
    Status.ABORTED,
    Status.RESOURCE_EXHAUSTED,
    Status.DEADLINE_EXCEEDED,
    Status.UNAVAILABLE,
    Status.CANCELLED,
}


class RawCodec(CodecBase):
    """Passes bytes through: the test writes and reads the protobuf itself."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        assert isinstance(message, bytes)
        return message

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


def varint(value: int) -> bytes:
    """``value`` as a protobuf varint (to build messages, valid or not, byte by byte)."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def frame(payload: bytes, declared: int | None = None, compressed: bool = False) -> bytes:
    """One gRPC frame; ``declared`` overrides the length it claims."""
    length = len(payload) if declared is None else declared
    return struct.pack(">?I", compressed, length) + payload


@dataclass
class Outcome:
    status: Status
    message: str
    replies: list[bytes] = field(default_factory=list)
    open: bool = False  # the server still streamed when the test stopped reading
    kind: ErrorKind | None = None  # the kind the status details carried, if any

    @property
    def refused(self) -> bool:
        return self.status is not Status.OK


def raw_channel(target: str, *, insecure: bool = False) -> Channel:
    """A channel to ``HOST:PORT`` (TLS as the environment says, unless ``insecure``) or
    ``unix:PATH``."""
    if target.startswith("unix:"):
        return Channel(path=target[5:], codec=RawCodec(), status_details_codec=KIND_CODEC)
    host, _, port = target.rpartition(":")
    context = None if insecure else env_context()
    return Channel(host, int(port), codec=RawCodec(), status_details_codec=KIND_CODEC, ssl=context)


async def raw_call(
    channel: Channel,
    method: str,
    data: bytes,
    *,
    end: bool = True,
    max_replies: int = 1,
    timeout: float = 5.0,
) -> Outcome:
    """Send ``data`` (framed bytes, as they go on the wire) on one stream of ``method``.

    Stops reading after ``max_replies`` replies (a watch, a registration or an agent stream
    stays open while the input is good) and then cancels the stream.
    """
    try:
        async with asyncio.timeout(timeout + 2):
            return await _call(channel, method, data, end, max_replies, timeout)
    except GRPCError as exc:  # raised on leaving the stream (a reset after the status)
        return _failed(exc)


def _failed(exc: GRPCError, replies: list[bytes] | None = None) -> Outcome:
    kind = exc.details if isinstance(exc.details, ErrorKind) else None
    return Outcome(exc.status, exc.message or "", replies or [], kind=kind)


async def _call(
    channel: Channel, method: str, data: bytes, end: bool, max_replies: int, timeout: float
) -> Outcome:
    stream = channel.request(method, Cardinality.STREAM_STREAM, bytes, bytes, timeout=timeout)
    async with stream:
        await stream.send_request()
        # The client stream's own framing would only send well-formed frames.
        await stream._stream.send_data(data, end_stream=end)
        stream._end_done = True  # what the stream would set had it sent the end itself
        replies: list[bytes] = []
        try:
            while len(replies) < max_replies:
                reply = await stream.recv_message()
                if reply is None:
                    break
                replies.append(reply)
            if len(replies) >= max_replies:
                with contextlib.suppress(Exception):
                    await stream.cancel()
                return Outcome(Status.OK, "", replies, open=True)
            await stream.recv_trailing_metadata()
        except GRPCError as exc:
            return _failed(exc, replies)
        except StreamTerminatedError as exc:
            return Outcome(Status.UNKNOWN, f"stream terminated: {exc}", replies)
        return Outcome(Status.OK, "", replies)
