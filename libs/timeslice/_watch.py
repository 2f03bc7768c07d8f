"""The open watches of one client (:meth:`timeslice.AsyncTimeSliceClient.watch`).

Watches need no session: each gets its own channels on its consumer's loop, so they work
from any loop and never compete with acquire for a connection. Closing the client ends every
open watch, from whatever thread it closes in: their connections are cut on their own loops,
and the read in progress fails with :class:`~timeslice.errors.Cancelled`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import cast

from timeslice._streams import Retry, retrying_stream
from timeslice._transport import Transport
from timeslice.errors import Cancelled, TimeSliceError, Unavailable
from timeslice.targets import Target
from timeslice.tls import ReloadingContext
from timeslice_proto.timeslice.v1 import GroupEvent, TimeSliceStub, WatchGroupRequest


class _OpenWatch:
    """One running watch: its connections, on its consumer's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: Transport) -> None:
        self.loop = loop
        self.transport = transport

    def end(self) -> None:
        """Close its connections, from any thread: a read in progress fails at once."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.transport.close()
            return
        # Channels belong to their loop: close them there.
        with contextlib.suppress(RuntimeError):  # that loop is closed, and the watch with it
            self.loop.call_soon_threadsafe(self.transport.close)


class Watches:
    """The watches of one client; see the module docstring.

    Args:
        targets, tls: where and how the client connects.
        job_id: the client's job (for messages).
        call_timeout: how long no replica may answer before a watch raises ``Unavailable``.
        closed: whether the client is closed.
    """

    def __init__(
        self,
        targets: Sequence[Target],
        tls: ReloadingContext | None,
        *,
        job_id: str,
        call_timeout: float,
        closed: Callable[[], bool],
    ) -> None:
        self._targets = list(targets)
        self._tls = tls
        self._job_id = job_id
        self._call_timeout = call_timeout
        self._closed = closed
        # Watches run on their consumers' loops, maybe in other threads than end_all().
        self._open: set[_OpenWatch] = set()
        self._lock = threading.Lock()

    async def follow(self, group: str) -> AsyncGenerator[GroupEvent, None]:
        """The group's status at every change, until the server ends the stream; see
        :meth:`timeslice.AsyncTimeSliceClient.watch`."""
        transport = Transport(self._targets, self._tls)

        def open_stream(target: Target, stub: TimeSliceStub) -> AsyncGenerator[GroupEvent, None]:
            request = WatchGroupRequest(group_id=group)
            return cast(AsyncGenerator[GroupEvent, None], stub.watch_group(request))

        def on_failure(exc: Exception, error: TimeSliceError | None) -> Retry | None:
            if self._closed() or not isinstance(error, Unavailable):
                return None
            return Retry.FAILOVER

        events = retrying_stream(
            transport,
            open_stream,
            what=f"WatchGroup({group})",
            outage_limit=lambda: self._call_timeout,
            on_failure=on_failure,
        )
        watch = _OpenWatch(asyncio.get_running_loop(), transport)
        with self._lock:
            self._open.add(watch)
        try:
            # The client may have closed in another thread since its caller checked, and
            # not seen us.
            if self._closed():
                raise Cancelled(f"the timeslice client of job {self._job_id} was closed")
            async with contextlib.aclosing(events):
                while True:
                    try:
                        event = await anext(events)
                    except StopAsyncIteration:
                        return
                    except Exception as exc:
                        if self._closed():
                            # Whatever broke, it was the close cutting the connections.
                            raise self._ended(group) from exc
                        raise
                    if self._closed():
                        # Read before the close, given after it: the watch has ended.
                        raise self._ended(group)
                    yield event
        finally:
            with self._lock:
                self._open.discard(watch)
            transport.close()

    def end_all(self) -> None:
        """End every open watch (the client is closing), from any thread."""
        with self._lock:
            watches = list(self._open)
        for watch in watches:
            watch.end()

    def _ended(self, group: str) -> Cancelled:
        return Cancelled(
            f"the timeslice client of job {self._job_id} was closed while watching {group}"
        )
