"""Yields over one long-lived stream per connection (the YieldStream method).

A Yield call costs the set-up of a gRPC call on both ends (a new HTTP/2 stream, its headers
encoded and parsed, a handler task, trailers); on a hand-over that is a fifth of the time from
the yield to the waiter's grant (docs/benchmarks.md). A YieldStream is opened once per
connection and carries one yield at a time: the request goes out as one message and its answer
comes back as one, with the status the Yield call would have ended with.

The stream is only a faster way to send the same Yield; everything about retries stays with
the caller (:meth:`timeslice._transport.Transport.unary`): each attempt of a yield is one
:meth:`YieldStreams.send`, which raises what a Yield call would have raised. A stream that
fails in any way (a lost connection, an attempt's deadline, the server ending it) is dropped,
and the next attempt opens a new one, so a late answer can never be taken for a later yield's.
A yield finding its connection's stream in use by another yield of the client, and every yield
to a server without the method (UNIMPLEMENTED: an older replica), is a Yield call instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from timeslice.errors import ErrorKind
from timeslice_proto.timeslice.v1 import (
    TimeSliceStub,
    YieldRequest,
    YieldStreamReply,
)

log = logging.getLogger("timeslice")

# How long closing a stream may take (the client is closing, or the stream failed).
_CLOSE_SECONDS = 1.0


def _method_missing(exc: GRPCError) -> bool:
    """Whether a call failed because the server does not have its method. A grpclib server
    (0.4.9, pinned) answers that UNIMPLEMENTED in a response without a content-type, which
    the grpclib client reports as UNKNOWN "Missing content-type header" before it reads the
    status; that response is also the only one of a grpclib server that lacks it."""
    if exc.status is Status.UNIMPLEMENTED:
        return True
    return exc.status is Status.UNKNOWN and exc.message == "Missing content-type header"


class _YieldStream:
    """One YieldStream call: one yield at a time, answered in order."""

    def __init__(self, stub: TimeSliceStub) -> None:
        self._outgoing: asyncio.Queue[YieldRequest | None] = asyncio.Queue()
        # The generated method is an async generator (typed as an iterator): close() ends it.
        self._replies = cast(
            AsyncGenerator[YieldStreamReply, None], stub.yield_stream(self._requests())
        )
        self.busy = False
        self.broken = False
        self.answered = False  # whether the server answered once (it has the method)

    async def _requests(self) -> AsyncIterator[YieldRequest]:
        while (request := await self._outgoing.get()) is not None:
            yield request

    async def send(self, request: YieldRequest, timeout: float) -> None:
        """One yield: returns on OK, raises :class:`GRPCError` with the status Yield would
        have ended with, or what the stream failed with (the stream is then broken)."""
        self.busy = True
        try:
            self._outgoing.put_nowait(request)
            async with asyncio.timeout(timeout):
                reply = await anext(self._replies)
        except StopAsyncIteration:
            self.broken = True
            raise GRPCError(Status.UNAVAILABLE, "the server ended the yield stream") from None
        except BaseException:
            self.broken = True
            raise
        finally:
            self.busy = False
        self.answered = True
        if reply.status != Status.OK.value:
            try:
                status = Status(reply.status)
            except ValueError:  # not a gRPC status: a server bug, told as such
                status = Status.UNKNOWN
            kind = ErrorKind.__members__.get(reply.kind)  # unknown or empty: by the status
            raise GRPCError(status, reply.message, kind)

    async def close(self) -> None:
        """End the stream (its requests first, then the call)."""
        self.broken = True
        self._outgoing.put_nowait(None)
        with contextlib.suppress(Exception, TimeoutError):
            async with asyncio.timeout(_CLOSE_SECONDS):
                await self._replies.aclose()


class YieldStreams:
    """The client's yield streams, one per connection (channel); see the module docstring."""

    def __init__(self) -> None:
        self._streams: dict[Channel, _YieldStream] = {}
        # Channels whose server answered UNIMPLEMENTED: their yields are Yield calls.
        self._unsupported: set[Channel] = set()

    @property
    def open_streams(self) -> int:
        """Streams that carried a yield and have not failed (tests, diagnostics)."""
        return sum(1 for s in self._streams.values() if s.answered and not s.broken)

    async def send(self, stub: TimeSliceStub, request: YieldRequest, timeout: float) -> None:
        """One attempt of a yield through ``stub``'s connection: over its stream when it
        can, else as a Yield call. Raises what a Yield call would."""
        channel = stub.channel
        if channel in self._unsupported:
            await stub.yield_(request, timeout=timeout)
            return
        stream = self._streams.get(channel)
        if stream is not None and stream.busy:
            await stub.yield_(request, timeout=timeout)  # another yield is on it
            return
        if stream is None or stream.broken:
            stream = self._streams[channel] = _YieldStream(stub)
        try:
            await stream.send(request, timeout)
        except GRPCError as exc:
            if stream.answered or not _method_missing(exc):
                raise
            # An older server: it never acted on the request.
            log.info("the server has no YieldStream (%s); yields are Yield calls there", exc)
            self._unsupported.add(channel)
            await stub.yield_(request, timeout=timeout)
        finally:
            if stream.broken:
                await self._drop(channel, stream)

    async def _drop(self, channel: Channel, stream: _YieldStream) -> None:
        if self._streams.get(channel) is stream:
            del self._streams[channel]
        await stream.close()

    async def close(self) -> None:
        """End every stream (the client is closing)."""
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            await stream.close()
