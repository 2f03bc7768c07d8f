"""Server streams that survive replica failures, and reading one ahead of its consumer.

:func:`retrying_stream` is the one failover loop of the SDK's streams (Acquire and
WatchGroup): when a replica cannot be reached the stream is opened again on the next one after
a backoff, until no replica delivered anything for the caller's outage limit. What a retry
means is the caller's business (Acquire re-attaches to its queue entry, a watch just gets the
full status again), so the caller decides which failures are retried.

:class:`Prefetch` reads a stream in a task of its own, so that a consumer that is cancelled can
still look at what already arrived (a cancel that reached the stream itself would reset it and
lose those messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from timeslice._transport import Transport, is_final
from timeslice.backoff import Backoff
from timeslice.errors import TimeSliceError, Unavailable
from timeslice.targets import Target
from timeslice_proto.timeslice.v1 import TimeSliceStub

log = logging.getLogger("timeslice")

T = TypeVar("T")


class Retry(enum.Enum):
    """What :func:`retrying_stream` does after a failed attempt."""

    FAILOVER = "failover"
    """The replica is unreachable: try the next one after a backoff (an outage is counted)."""
    AGAIN = "again"
    """The caller fixed what was wrong (a new session): open the stream again at once."""


OnFailure = Callable[[Exception, TimeSliceError | None], Retry | None]
"""Decides on a failed attempt: given the exception and its typed error (``None`` when it is
not a transport failure), return how to retry, ``None`` to raise the error, or raise."""


def failover_when_unavailable(exc: Exception, error: TimeSliceError | None) -> Retry | None:
    """The default :data:`OnFailure`: only an unreachable replica is worth another try (not
    one that requires a client certificate we do not have)."""
    return Retry.FAILOVER if isinstance(error, Unavailable) and not is_final(error) else None


def _same_error(error: TimeSliceError, down_for: float) -> TimeSliceError:
    return error


async def retrying_stream(
    transport: Transport,
    open_stream: Callable[[Target, TimeSliceStub], AsyncGenerator[T, None]],
    *,
    what: str,
    outage_limit: Callable[[], float],
    before_attempt: Callable[[], Awaitable[None]] | None = None,
    on_failure: OnFailure = failover_when_unavailable,
    outage_error: Callable[[TimeSliceError, float], TimeSliceError] = _same_error,
) -> AsyncGenerator[T, None]:
    """Yield the messages of a server stream, re-opening it on another replica after failures.

    Args:
        transport: the connections; failover moves its current target.
        open_stream: opens the stream on one target (called once per attempt).
        what: names the stream in errors and logs, e.g. ``"Acquire(g1)"``.
        outage_limit: seconds without a message after which failover gives up (asked at
            each failure, so it may change, e.g. with the session).
        before_attempt: awaited before every attempt; what it raises ends the stream as is.
        on_failure: classifies a failed attempt (see :data:`OnFailure`).
        outage_error: the error raised when the outage lasted too long, given the last
            failure and how long no replica answered.

    The stream ends when an attempt ends normally. Every message resets the outage clock and
    the backoff: a replica that delivers is healthy.
    """
    loop = asyncio.get_running_loop()
    backoff = Backoff()
    down_since: float | None = None
    while True:
        if before_attempt is not None:
            await before_attempt()
        target, stub = transport.stub()
        try:
            # aclosing: the stream is reset as soon as our consumer stops.
            async with contextlib.aclosing(open_stream(target, stub)) as messages:
                async for message in messages:
                    down_since = None
                    backoff.reset()
                    yield message
            return
        except Exception as exc:
            error = transport.map_error(exc, f"{what} via {target}")
            decision = on_failure(exc, error)
            if decision is None:
                if error is None:
                    raise
                raise error from exc
            if decision is Retry.AGAIN:
                continue
            assert error is not None, "failover needs a typed error"
            now = loop.time()
            if down_since is None:
                down_since = now
            elif now - down_since > outage_limit():
                raise outage_error(error, now - down_since) from exc
            transport.rotate(target)
            log.warning("%s: %s; re-attaching via %s", what, error, transport.current)
            await asyncio.sleep(backoff.next_delay())


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


class _End:
    pass


_END = _End()


class Prefetch(Generic[T]):
    """Reads ``source`` in its own task; :meth:`next` hands over what it read, in order.

    Close it with :meth:`aclose`, which cancels the reading (and so the stream) and waits.
    """

    def __init__(self, source: AsyncGenerator[T, None], name: str) -> None:
        self._items: asyncio.Queue[T | _Failed | _End] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._read(source), name=name)

    async def _read(self, source: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(source) as items:
                async for item in items:
                    self._items.put_nowait(item)
        except Exception as exc:
            self._items.put_nowait(_Failed(exc))
        else:
            self._items.put_nowait(_END)

    async def next(self, timeout: float | None = None) -> T | None:
        """The next message; ``None`` once the stream ended; raises what the stream raised.

        With ``timeout``, raises :class:`TimeoutError` when nothing arrives in time.
        """
        async with asyncio.timeout(timeout):
            item = await self._items.get()
        if isinstance(item, _Failed):
            # Re-raise it on every later call too: the stream stays failed.
            self._items.put_nowait(item)
            raise item.error
        if isinstance(item, _End):
            self._items.put_nowait(item)
            return None
        return item

    async def aclose(self) -> None:
        """Stop reading (cancelling the stream) and wait until the reader is gone."""
        self._task.cancel()
        await asyncio.wait([self._task])
