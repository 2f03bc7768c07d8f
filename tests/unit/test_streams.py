"""The SDK's stream helpers (timeslice._streams): which failures fail over, and a prefetching
reader that keeps what arrived, ends, and fails the way its stream did. ``retrying_stream``'s
failover against real replicas is in tests/sdk/test_aio_client.py and
tests/faults/test_agent_and_client_faults.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from timeslice._streams import Prefetch, Retry, failover_when_unavailable
from timeslice.errors import ConnectionFailed, InvalidArgument, NotFound, Unavailable


def test_only_an_outage_a_retry_can_heal_fails_over() -> None:
    boom = RuntimeError("transport")
    assert failover_when_unavailable(boom, Unavailable("down")) is Retry.FAILOVER
    assert failover_when_unavailable(boom, ConnectionFailed("refused")) is Retry.FAILOVER
    # A server that wants a client certificate we have none of: no replica will differ.
    assert failover_when_unavailable(boom, ConnectionFailed("no cert", final=True)) is None
    assert failover_when_unavailable(boom, InvalidArgument("bad")) is None
    assert failover_when_unavailable(boom, None) is None


async def _items(*values: int, fail: Exception | None = None) -> AsyncGenerator[int, None]:
    for value in values:
        yield value
    if fail is not None:
        raise fail


async def test_prefetch_hands_over_in_order_then_none_for_good() -> None:
    prefetch = Prefetch(_items(1, 2, 3), "test")
    try:
        assert [await prefetch.next(5) for _ in range(3)] == [1, 2, 3]
        assert await prefetch.next(5) is None
        assert await prefetch.next(5) is None  # the end stays the end
    finally:
        await prefetch.aclose()


async def test_prefetch_raises_what_the_stream_raised_on_every_later_call() -> None:
    prefetch = Prefetch(_items(1, fail=NotFound("gone")), "test")
    try:
        assert await prefetch.next(5) == 1
        for _ in range(2):
            with pytest.raises(NotFound, match="gone"):
                await prefetch.next(5)
    finally:
        await prefetch.aclose()


async def test_a_consumer_cancelled_while_waiting_loses_nothing() -> None:
    go = asyncio.Event()

    async def late() -> AsyncGenerator[int, None]:
        await go.wait()
        yield 7
        yield 8

    prefetch = Prefetch(late(), "test")
    try:
        waiting = asyncio.create_task(prefetch.next(5))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        # The cancel reached the consumer, not the stream: what it sends next still arrives.
        go.set()
        assert [await prefetch.next(5), await prefetch.next(5)] == [7, 8]
        assert await prefetch.next(5) is None
    finally:
        await prefetch.aclose()


async def test_prefetch_next_times_out_and_aclose_stops_the_stream() -> None:
    closed = asyncio.Event()

    async def silent() -> AsyncGenerator[int, None]:
        try:
            await asyncio.Event().wait()
            yield 0
        finally:
            closed.set()

    prefetch = Prefetch(silent(), "test")
    with pytest.raises(TimeoutError):
        await prefetch.next(0.01)
    await prefetch.aclose()
    # aclose waits for the reader: the stream was closed by the time it returns.
    assert closed.is_set()
