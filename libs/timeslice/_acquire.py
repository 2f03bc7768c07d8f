"""One acquire call: the Acquire stream, its failover to other replicas, and re-attachment.

The orchestrator streams QUEUED / SWITCHING progress and ends with GRANTED. When the replica
serving the stream goes away, the same request (same session, same ``request_id``) is sent to
the next replica, which re-attaches it to the queue entry it already has: the job keeps its
place. If the session itself expired, the entry went with it, so the call queues again once
under a new session.

Aborting (a cancel, the caller's timeout, a failing ``on_progress``) resets the stream, which
makes the orchestrator drop the queue entry. A GRANTED may already be on its way at that
moment; the stream is read in a task of its own (:class:`~timeslice._streams.Prefetch`) so
that such a grant is still seen, and the client gives it back. One that is still on the wire
when the reset goes out is never seen (the server finished its stream before the reset
arrived, so it keeps the grant): the client then looks the group up and gives back a hold of
its own that it has no record of (:mod:`timeslice._sweep`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, cast

from timeslice._session import Session
from timeslice._streams import Prefetch, Retry, failover_when_unavailable, retrying_stream
from timeslice._transport import Transport, map_error
from timeslice._types import AcquireProgress, AcquireStage
from timeslice.errors import Cancelled, InternalError, SessionExpired, TimeSliceError, Unavailable
from timeslice.targets import Target
from timeslice_proto.timeslice.v1 import (
    AcquireEvent,
    AcquireRequest,
    TimeSliceStub,
)

log = logging.getLogger("timeslice")
# Set (True) on the log record of a grant's warning, for a program that shows the warning
# itself (the CLI) to leave that record out.
GRANT_WARNING = "timeslice_grant_warning"

ProgressCallback = Callable[[AcquireProgress], None]
"""Called with each :class:`~timeslice.AcquireProgress` of a pending acquire."""

# How long an aborted acquire looks at what the server already sent, to catch a GRANTED that
# raced the abort (it is in our receive buffer, so this never waits on the network for long).
_DRAIN_SECONDS = 0.02


def log_grant_warning(job_id: str, group: str, warning: str) -> None:
    """Say a grant's warning (likely not what the job meant: a mistyped group) where the
    job's operator looks; the client says it once per group (:class:`~._core.ClientCore`)."""
    log.warning("acquire of %s by job %s: %s", group, job_id, warning, extra={GRANT_WARNING: True})


class _Moved:
    pass


_MOVED = _Moved()


class _Stream:
    """One Acquire stream, read one event at a time, that can be left open unread and
    closed later (reading is a task of its own so that a read can be raced)."""

    def __init__(self, events: AsyncGenerator[AcquireEvent, None]) -> None:
        self._events = events
        self._step: asyncio.Future[AcquireEvent] | None = None

    async def next(
        self, unless: asyncio.Future[None] | None = None
    ) -> AcquireEvent | _Moved | None:
        """The next event, None at the end; ``_MOVED`` if ``unless`` finished first (the read
        goes on, for the next call or :meth:`close`)."""
        if self._step is None and unless is None:
            # Nothing to race: read in place (no task per event on the hot path).
            try:
                return await anext(self._events)
            except StopAsyncIteration:
                return None
        if self._step is None:
            self._step = asyncio.ensure_future(anext(self._events))
        step = self._step
        if unless is not None:
            racing: set[asyncio.Future[Any]] = {step, unless}
            await asyncio.wait(racing, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                return _MOVED
        try:
            return await step
        except StopAsyncIteration:
            return None
        finally:
            if step.done():
                self._step = None

    async def close(self) -> AcquireEvent | None:
        """Stop reading and reset the stream (if the server has not ended it); returns an
        event the pending read had received, which nobody had taken."""
        step, self._step = self._step, None
        received = None
        if step is not None:
            step.cancel()
            await asyncio.wait({step})
            if not step.cancelled() and step.exception() is None:
                received = step.result()
        await self._events.aclose()
        return received


class AcquireCall:
    """Waits for one group on behalf of one client; see the module docstring.

    Args:
        transport: the client's connections.
        job_id, group, priority: what the Acquire request asks for.
        on_progress: called with each QUEUED / SWITCHING report (not with GRANTED).
        open_session: the client's current session, opening one if there is none.
        check_open: raises :class:`~timeslice.errors.Cancelled` once the client is closed.
        closed: whether the client is closed.

    After :meth:`until_granted`, :attr:`granted` is the GRANTED event and :attr:`session` the
    session it was granted under; both are also set when the call was aborted after a grant
    arrived, so that the caller can give the grant back. The caller then runs :meth:`finish`,
    which reads the rest of the stream.
    """

    def __init__(
        self,
        transport: Transport,
        *,
        job_id: str,
        group: str,
        priority: int,
        on_progress: ProgressCallback | None,
        open_session: Callable[[], Awaitable[Session]],
        check_open: Callable[[], None],
        closed: Callable[[], bool],
        strict_groups: bool = False,
    ) -> None:
        self._transport = transport
        self._strict_groups = strict_groups
        self._job_id = job_id
        self._group = group
        self._priority = priority
        self._on_progress = on_progress
        self._open_session = open_session
        self._check_open = check_open
        self._closed = closed
        self._renewed = False
        self.session: Session | None = None
        self.granted: AcquireEvent | None = None
        self.events = 0
        # Whether a request went out: from then on the server may grant it, seen or not.
        self.sent = False
        # The create revision of our queue entry, once an event named it (0: none did).
        self.ticket = 0
        # Sent with every attempt of this acquire so the server can recognise a retry.
        self.request_id = uuid.uuid4().hex
        # Streams left, still open, for a replica that seemed cut off from etcd: closed once
        # another attempt has re-attached (see _attempt).
        self._detached: list[_Stream] = []
        # The granted stream's reader, until finish() has read it to its end.
        self._tail: Prefetch[AcquireEvent] | None = None

    @property
    def group(self) -> str:
        return self._group

    def request(self, session: Session) -> AcquireRequest:
        """This call's request under ``session``: every attempt sends the same one."""
        return AcquireRequest(
            session_id=session.session_id,
            session_secret=session.secret,
            job_id=self._job_id,
            group_id=self._group,
            priority=self._priority,
            request_id=self.request_id,
            strict_groups=self._strict_groups,
        )

    async def until_granted(self) -> None:
        """Return as soon as GRANTED arrives; raise the typed error otherwise.

        The server ends the stream right after GRANTED. Waiting for that end would make every
        acquire wait for one more read, so :meth:`finish`, which the caller runs in the
        background, reads the rest. The stream is not reset meanwhile: a reset that reached
        the server before it sent GRANTED would make it take the grant back (it cannot once
        it has sent it, but a reset is not needed either).
        """
        stream = retrying_stream(
            self._transport,
            self._attempt,
            what=f"Acquire({self._group})",
            outage_limit=self._outage_limit,
            before_attempt=self._before_attempt,
            on_failure=self._on_failure,
            outage_error=self._outage_error,
        )
        reader = Prefetch(stream, name=f"timeslice-acquire-{self._group}")
        try:
            while self.granted is None:
                event = await reader.next()
                if event is None:
                    break
                self._on_event(event)
        except BaseException:
            try:
                await self._drain(reader)
            finally:
                await self._close(reader)
            raise
        if self.granted is not None:
            self._tail = reader
            return
        await self._close(reader)
        if self.granted is None:
            raise InternalError(f"the Acquire stream of group {self._group} ended without a grant")

    async def finish(self, limit: float) -> None:
        """Read the granted stream to its end (at most ``limit`` seconds), then close it and
        any stream a move left open. Does nothing unless :meth:`until_granted` returned."""
        reader, self._tail = self._tail, None
        if reader is None:
            return
        try:
            async with asyncio.timeout(limit):
                while await reader.next() is not None:
                    pass
        except TimeoutError:
            log.info("the Acquire stream of %s did not end %gs after GRANTED", self._group, limit)
        except Exception as exc:
            # The grant stands: only the stream's tail failed (see _attempt).
            log.info("the Acquire stream of %s failed after GRANTED: %s", self._group, exc)
        finally:
            await self._close(reader)

    async def _close(self, reader: Prefetch[AcquireEvent]) -> None:
        """Stop ``reader`` and close the streams left open by moves; a GRANTED that reached
        one of those is ours too (when the call is being aborted, the caller gives it back)."""
        try:
            await reader.aclose()
        finally:
            left = await self._close_detached()
            if left is not None and self.granted is None:
                self.granted = left

    # ------------------------------------------------------------ one attempt

    async def _before_attempt(self) -> None:
        self._check_open()
        self.session = await self._open_session()

    async def _attempt(
        self, target: Target, stub: TimeSliceStub
    ) -> AsyncGenerator[AcquireEvent, None]:
        assert self.session is not None
        request = self.request(self.session)
        granted = False
        self.sent = True
        # No gRPC deadline: the wait is bounded by the caller's timeout (or not at all), and
        # aborting is done by cancelling, which resets the stream.
        stream = _Stream(cast(AsyncGenerator[AcquireEvent, None], stub.acquire(request)))
        # A call (the session's keepalive) that fails on this replica and works on another:
        # this one may no longer follow etcd, and would never tell us of our grant (see
        # Transport.failed_over_from). The wait moves there, re-attaching to its place.
        moved = asyncio.ensure_future(self._transport.failed_over_from(target))
        answered = False
        try:
            while True:
                if granted or not answered:
                    # Not before this replica's first answer: until then its enqueue may still
                    # be under way, and would land (re-stamping our entry) after a move.
                    event = await stream.next()
                else:
                    event = await stream.next(unless=moved)
                    if event is _MOVED:
                        # Not reset yet: the old replica, should it reach etcd meanwhile,
                        # would withdraw our entry before the new one re-stamps it.
                        self._detached.append(stream)
                        raise Unavailable(
                            f"{target} failed a call that another replica then served: "
                            "waiting there instead"
                        )
                if event is None:
                    return
                assert isinstance(event, AcquireEvent)
                answered = True
                self._transport.worked(target)
                if self._detached:
                    # This attempt has re-attached (its first answer came after the entry
                    # was re-stamped): what the old ones leave behind is no longer ours.
                    await self._close_detached()
                if AcquireStage.from_wire(event.state) is AcquireStage.GRANTED:
                    granted = True
                # After GRANTED the stream is still read to its end: resetting it before
                # the server finished would make the server take the grant back.
                yield event
        except Exception as exc:
            if not granted:
                raise
            # The grant arrived; only the tail of the stream failed. The grant stands.
            log.warning(
                "Acquire stream of %s via %s failed after the grant: %s",
                self._group,
                target,
                map_error(exc, target) or exc,
            )
        finally:
            moved.cancel()
            if stream not in self._detached:
                await stream.close()

    async def _close_detached(self) -> AcquireEvent | None:
        """Close the streams left open by moves (one at a time: a cancel meanwhile leaves the
        rest listed for the caller's own clean-up); returns a GRANTED one of them received."""
        granted = None
        while self._detached:
            try:
                event = await self._detached[-1].close()
            finally:
                self._detached.pop()
            if event is not None and AcquireStage.from_wire(event.state) is AcquireStage.GRANTED:
                granted = event
        return granted

    def _on_failure(self, exc: Exception, error: TimeSliceError | None) -> Retry | None:
        if self._closed():
            raise Cancelled(
                f"the client of job {self._job_id} was closed while acquiring {self._group}"
            ) from exc
        if isinstance(error, SessionExpired) and not self._renewed and self.session is not None:
            # The queue place went with the session; queue again under a new one.
            self.session.lose(f"Acquire: {error}")
            self._renewed = True
            return Retry.AGAIN
        # Re-issuing Acquire with the same session re-attaches to our queue entry.
        return failover_when_unavailable(exc, error)

    def _outage_limit(self) -> float:
        # Past the session's TTL the lease, and our place in the queue with it, is gone.
        assert self.session is not None
        return self.session.ttl

    def _outage_error(self, error: TimeSliceError, down_for: float) -> TimeSliceError:
        return Unavailable(
            f"no orchestrator replica reachable for {down_for:.1f}s while acquiring "
            f"{self._group}; the session has expired: {error}"
        )

    # ----------------------------------------------------------------- events

    def _on_event(self, event: AcquireEvent) -> None:
        self.events += 1
        if event.ticket:
            self.ticket = int(event.ticket)
        stage = AcquireStage.from_wire(event.state)
        if stage is AcquireStage.GRANTED:
            self.granted = event
            return
        if stage is None:
            log.warning("ignoring Acquire event with unknown state %r", event.state)
            return
        if self._on_progress is not None:
            self._on_progress(AcquireProgress(stage, int(event.queue_position)))

    async def _drain(self, reader: Prefetch[AcquireEvent]) -> None:
        """Look at events already received when the acquire is aborted.

        A GRANTED event may have arrived when the abort lands; the server has then finished
        the stream and cannot see our cancel, so we must notice the grant ourselves and give
        it back.
        """
        while self.granted is None:
            try:
                event = await reader.next(_DRAIN_SECONDS)
            except (Exception, asyncio.CancelledError):
                return
            if event is None:
                return
            self.events += 1
            if AcquireStage.from_wire(event.state) is AcquireStage.GRANTED:
                self.granted = event
