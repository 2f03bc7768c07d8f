"""The SDK's choice between its yield stream and a Yield call (timeslice._yields).

A fake stub stands in for the connection (the wire is tested on real replicas in
tests/integration/test_yield_stream.py): what matters here is which way each yield goes and
that a stream is never used again after it failed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import cast

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from timeslice._yields import YieldStreams
from timeslice_proto.timeslice.v1 import (
    TimeSliceStub,
    YieldRequest,
    YieldResponse,
    YieldStreamReply,
)


class FakeStub:
    """``yield_stream`` answers each request after ``delay`` with ``reply``; ``yield_`` counts."""

    def __init__(self) -> None:
        self.channel = object()
        self.calls = 0
        self.streams = 0
        self.delay = 0.0
        self.reply = YieldStreamReply()
        self.unimplemented = False
        # How a grpclib client may see a grpclib server's "method not found" (see _yields).
        self.missing = GRPCError(Status.UNIMPLEMENTED, "Method not found")

    async def yield_(self, request: YieldRequest, *, timeout: float) -> YieldResponse:
        self.calls += 1
        return YieldResponse()

    async def yield_stream(
        self, requests: AsyncIterator[YieldRequest]
    ) -> AsyncIterator[YieldStreamReply]:
        self.streams += 1
        if self.unimplemented:
            raise self.missing
        async for _ in requests:
            await asyncio.sleep(self.delay)
            yield self.reply


def _stub(fake: FakeStub) -> TimeSliceStub:
    return cast(TimeSliceStub, fake)


REQUEST = YieldRequest(session_id="s", job_id="j", group_id="g", epoch=1)


async def test_yields_share_one_stream() -> None:
    fake, streams = FakeStub(), YieldStreams()
    for _ in range(3):
        await streams.send(_stub(fake), REQUEST, 5)
    assert (fake.streams, fake.calls, streams.open_streams) == (1, 0, 1)
    await streams.close()


async def test_a_refusal_keeps_the_stream_and_raises_the_status() -> None:
    fake, streams = FakeStub(), YieldStreams()
    fake.reply = YieldStreamReply(status=Status.NOT_FOUND.value, message="not the holder")
    with pytest.raises(GRPCError) as raised:
        await streams.send(_stub(fake), REQUEST, 5)
    assert (raised.value.status, raised.value.message) == (Status.NOT_FOUND, "not the holder")
    fake.reply = YieldStreamReply()
    await streams.send(_stub(fake), REQUEST, 5)
    assert (fake.streams, streams.open_streams) == (1, 1)
    await streams.close()


async def test_a_yield_finding_the_stream_busy_is_a_yield_call() -> None:
    fake, streams = FakeStub(), YieldStreams()
    fake.delay = 0.2
    await asyncio.gather(*(streams.send(_stub(fake), REQUEST, 5) for _ in range(2)))
    assert (fake.streams, fake.calls) == (1, 1)
    await streams.close()


async def test_a_stream_that_timed_out_is_never_used_again() -> None:
    # Its answer may still come: it must not be taken for the next yield's.
    fake, streams = FakeStub(), YieldStreams()
    fake.delay = 1.0
    with pytest.raises(TimeoutError):
        await streams.send(_stub(fake), REQUEST, 0.05)
    assert streams.open_streams == 0
    fake.delay = 0.0
    await streams.send(_stub(fake), REQUEST, 5)
    assert (fake.streams, streams.open_streams) == (2, 1)
    await streams.close()


@pytest.mark.parametrize(
    "missing",
    [
        GRPCError(Status.UNIMPLEMENTED, "Method not found"),
        # A grpclib server answers it without a content-type; the grpclib client can then
        # report that before the status (which of the two comes out depends on timing).
        GRPCError(Status.UNKNOWN, "Missing content-type header"),
    ],
    ids=["unimplemented", "grpclib-trailers-only"],
)
async def test_a_server_without_the_method_gets_yield_calls_from_then_on(
    missing: GRPCError,
) -> None:
    fake, streams = FakeStub(), YieldStreams()
    fake.unimplemented = True
    fake.missing = missing
    for _ in range(3):
        await streams.send(_stub(fake), REQUEST, 5)
    assert (fake.streams, fake.calls, streams.open_streams) == (1, 3, 0)


async def test_unimplemented_after_an_answer_is_raised_not_retried() -> None:
    # Only a server that never answered on the stream lacks the method; afterwards the
    # status is the yield's own, and the caller's retry logic owns it.
    fake, streams = FakeStub(), YieldStreams()
    await streams.send(_stub(fake), REQUEST, 5)
    fake.reply = YieldStreamReply(status=Status.UNIMPLEMENTED.value, message="odd")
    with pytest.raises(GRPCError):
        await streams.send(_stub(fake), REQUEST, 5)
    assert fake.calls == 0


async def test_the_server_ending_the_stream_is_unavailable() -> None:
    fake, streams = FakeStub(), YieldStreams()

    async def ended(requests: AsyncIterator[YieldRequest]) -> AsyncIterator[YieldStreamReply]:
        fake.streams += 1
        await anext(aiter(requests))
        return
        yield YieldStreamReply()  # an async generator that ends without a reply

    setattr(fake, "yield_stream", ended)  # noqa: B010
    with pytest.raises(GRPCError) as raised:
        await streams.send(_stub(fake), REQUEST, 5)
    assert raised.value.status is Status.UNAVAILABLE
    assert streams.open_streams == 0


async def test_another_failure_before_any_answer_is_raised() -> None:
    # Not a missing method: what a Yield call would raise, for the caller's retries.
    fake, streams = FakeStub(), YieldStreams()
    fake.unimplemented = True
    fake.missing = GRPCError(Status.UNKNOWN, "Internal Server Error")
    with pytest.raises(GRPCError):
        await streams.send(_stub(fake), REQUEST, 5)
    assert fake.calls == 0 and streams.open_streams == 0


async def test_a_reply_with_no_grpc_status_is_unknown() -> None:
    fake, streams = FakeStub(), YieldStreams()
    fake.reply = YieldStreamReply(status=99, message="what")
    with pytest.raises(GRPCError) as raised:
        await streams.send(_stub(fake), REQUEST, 5)
    assert (raised.value.status, raised.value.message) == (Status.UNKNOWN, "what")
    await streams.close()
