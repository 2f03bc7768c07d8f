"""What the client does on its own event loop: the session, and acquire and yield per group.

:class:`~timeslice.AsyncTimeSliceClient` is the public shell (arguments, loops, watches);
its :class:`~timeslice.runner.ClientRunner` drives a :class:`ClientCore` on the client's
loop. The core keeps the session (opened by the first acquire, kept alive, lost) and one
:class:`~timeslice._tenure.Tenure` per group, and makes the calls that move them:

- acquire (:mod:`timeslice._acquire` makes the call): refused or begun by the tenure, waits
  out the group's clean-up, records the grant; an abort gives back a grant that raced it, or
  sweeps (:mod:`timeslice._sweep`) for one it never saw;
- yield: gives back the grant; unconfirmed, the release goes on in the background
  (:mod:`timeslice._release`) and the job's retry of the yield waits for it.

Sessions: if the orchestrator says the session expired, everything it held is gone: the core
forgets its grants and opens a new session on the next acquire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from timeslice import _trace_context
from timeslice._acquire import AcquireCall, ProgressCallback, log_grant_warning
from timeslice._release import PendingRelease
from timeslice._session import Session
from timeslice._sweep import sweep
from timeslice._tenure import Tenure, Tenures, TenureState
from timeslice._transport import Transport
from timeslice._types import AcquireProgress, AcquireStage, Grant
from timeslice._yields import YieldStreams
from timeslice.errors import (
    Cancelled,
    NotHolder,
    PermissionDenied,
    SessionExpired,
    Timeout,
    Unavailable,
)
from timeslice.tasks import Supervisor
from timeslice.worker import check_can_enter
from timeslice_proto.timeslice.v1 import (
    GetGroupStatusRequest,
    GroupStatus,
    KeepAliveResponse,
    TimeSliceStub,
    YieldRequest,
)

log = logging.getLogger("timeslice")

T = TypeVar("T")

# CloseSession is best effort: the lease expires on its own if the orchestrator is away.
_CLOSE_BUDGET = 3.0


class ClientCore:
    """One client's session and tenures, on the client's loop; see the module docstring.

    Args:
        transport: the client's connections.
        job_id, session_ttl, call_timeout, on_yield_request: as the client was given them.
        tasks: the client's supervisor (keepalive, releases, sweeps, ends of acquires).
        yield_streams: the long-lived Yield streams (:mod:`timeslice._yields`).
    """

    def __init__(
        self,
        transport: Transport,
        *,
        job_id: str,
        session_ttl: float,
        call_timeout: float,
        on_yield_request: Callable[[str], None] | None,
        tasks: Supervisor,
        yield_streams: YieldStreams,
        strict_groups: bool = False,
    ) -> None:
        self.job_id = job_id
        # Sent with every Acquire: refuse a group that is not known (docs/groups.md).
        self._strict_groups = strict_groups
        # Groups whose grant warning was logged: once per group and client, not every step
        # of a loop (every Grant still carries it).
        self._warned: set[str] = set()
        self._transport = transport
        self._session_ttl = session_ttl
        self._call_timeout = call_timeout
        self._on_yield_request = on_yield_request
        self._tasks = tasks
        self._yield_streams = yield_streams
        self.tenures = Tenures(job_id)
        self.session: Session | None = None
        self._session_lock = asyncio.Lock()
        self.closed = False
        self.yield_requests: set[str] = set()
        self.keepalives_sent = 0
        self.last_session_loss: str | None = None

    # ------------------------------------------------------------------- calls

    def check_open(self) -> None:
        """Raise :class:`Cancelled` once the client is closed."""
        if self.closed:
            raise Cancelled(f"the timeslice client of job {self.job_id} was closed")

    async def unary(self, what: str, call: Callable[[TimeSliceStub, float], Awaitable[T]]) -> T:
        """One unary call, failed over between replicas within ``call_timeout``."""
        self.check_open()
        return await self._transport.unary(what, call, budget=self._call_timeout)

    async def group_status(self, group: str) -> GroupStatus:
        """The group's status, from whichever replica answers."""

        async def call(stub: TimeSliceStub, timeout: float) -> GroupStatus:
            request = GetGroupStatusRequest(group_id=group)
            return await stub.get_group_status(request, timeout=timeout)

        return await self.unary(f"GetGroupStatus({group})", call)

    # ----------------------------------------------------------------- session

    async def ensure_session(self) -> Session:
        """The open session, opening one if there is none."""
        async with self._session_lock:
            if self.session is not None:
                return self.session
            self.check_open()
            session = await Session.open(
                self._transport,
                job_id=self.job_id,
                ttl=self._session_ttl,
                call_timeout=self._call_timeout,
                on_keepalive=self._on_keepalive,
                on_lost=self._on_session_lost,
            )
            self.session = session
            session.keep_alive(self._tasks.spawn)
            log.debug(
                "job %s opened session %s (ttl %.3gs)", self.job_id, session.session_id, session.ttl
            )
            return session

    def _on_keepalive(self, reply: KeepAliveResponse) -> None:
        self.keepalives_sent += 1
        groups = set(reply.yield_requested)
        for group in groups - self.yield_requests:
            log.info("the orchestrator asks job %s to yield %s", self.job_id, group)
            if self._on_yield_request is not None:
                self._on_yield_request(group)
        self.yield_requests = groups

    def _on_session_lost(self, session: Session, reason: str) -> None:
        if self.session is not session:
            return
        self.session = None
        self.last_session_loss = reason
        lost = self.tenures.session_lost(session)
        log.warning(
            "session %s of job %s is gone (%s); holds released: %s; a new session opens on "
            "the next acquire",
            session.session_id,
            self.job_id,
            reason,
            ", ".join(lost) or "none",
        )

    # ----------------------------------------------------------------- acquire

    async def acquire(
        self,
        group: str,
        timeout: float | None,
        priority: int,
        on_progress: ProgressCallback | None,
    ) -> Grant:
        """Acquire ``group`` (arguments already checked); see
        :meth:`timeslice.AsyncTimeSliceClient.acquire`."""
        self.check_open()
        # Before anything is sent: the process could not serve the phase.
        check_can_enter(self.job_id, group)
        call = AcquireCall(
            self._transport,
            job_id=self.job_id,
            group=group,
            priority=priority,
            on_progress=on_progress,
            open_session=self.ensure_session,
            check_open=self.check_open,
            closed=lambda: self.closed,
            strict_groups=self._strict_groups,
        )
        tenure = self.tenures[group]
        tenure.begin_acquire()
        try:
            grant = await self._until_granted(tenure, call, timeout, on_progress)
            tenure.acquired(grant)
            if grant.warning and group not in self._warned:
                self._warned.add(group)
                log_grant_warning(self.job_id, group, grant.warning)
            return grant
        except BaseException:
            session = call.session
            if session is not None and session is self.session:
                if call.granted is not None:
                    await self._give_back_raced(tenure, session, call.granted.epoch)
                elif call.sent and not session.done:
                    task = self._tasks.spawn(
                        sweep(self, session, call), f"timeslice-sweep-{group}", kind="sweep"
                    )
                    tenure.sweep_after_abort(task)
            raise
        finally:
            if tenure.state is TenureState.ACQUIRING:
                tenure.acquire_failed()

    async def _until_granted(
        self,
        tenure: Tenure,
        call: AcquireCall,
        timeout: float | None,
        on_progress: ProgressCallback | None,
    ) -> Grant:
        group = tenure.group
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        limit = asyncio.timeout_at(deadline)
        try:
            async with limit:
                # Our own yield of the group still on its way lands first (now, not after its
                # backoff), and a grant an aborted acquire may have been given unseen goes
                # back, or this one meets it; then the acquire queues as anyone would.
                await tenure.cleared()
                await call.until_granted()
                # The stream's end follows GRANTED: read it without making the job wait.
                self._tasks.spawn(
                    call.finish(self._call_timeout),
                    f"timeslice-acquire-end-{group}",
                    kind="acquire end",
                )
        except TimeoutError:
            if limit.expired():
                # No replica ever answered this acquire, and none answers now: that is the
                # reason, not "not granted" (a queued acquire that lost its replica is).
                unreachable = self._transport.outage(f"Acquire({group})", timeout or 0.0)
                if unreachable is not None and call.events == 0:
                    raise unreachable from None
                raise Timeout(
                    f"job {self.job_id} was not granted group {group} within {timeout:g}s"
                ) from None
            raise
        granted, session = call.granted, call.session
        assert granted is not None and session is not None
        if session is not self.session:
            raise SessionExpired(
                f"the session of job {self.job_id} was lost right after group {group} was "
                f"granted ({self.last_session_loss})"
            )
        if on_progress is not None:
            on_progress(AcquireProgress(AcquireStage.GRANTED, 0))
        return Grant.from_event(group, self.job_id, granted)

    async def _give_back_raced(self, tenure: Tenure, session: Session, epoch: int) -> None:
        """Yield a grant that arrived while its acquire was being aborted."""
        group = tenure.group
        log.info("acquire of %s aborted after the grant (epoch %d); yielding it", group, epoch)
        try:
            await self._tasks.finish_even_if_cancelled(
                self.send_yield(session, group, epoch), f"timeslice-yield-{group}"
            )
        except (Unavailable, Timeout) as exc:
            # Not confirmed: keep sending it, as for a yield (the grant must not stay held).
            log.warning("give-back of %s (epoch %d) not confirmed yet: %s", group, epoch, exc)
            if not self.closed and not session.done:
                # The job never learned of this grant: a yield of the group is not its retry.
                release = self._release(session, group, epoch)
                tenure.give_back_later(release)
                self._start(release)
        except Exception as exc:
            # The acquire's own error is what propagates; this one must still be seen.
            log.error(
                "could not give back group %s (epoch %d) after an aborted acquire: %s",
                group,
                epoch,
                exc,
            )

    # ------------------------------------------------------------------- yield

    async def yield_(self, group: str) -> None:
        """Yield ``group`` (checked); see :meth:`timeslice.AsyncTimeSliceClient.yield_`."""
        self.check_open()
        tenure = self.tenures[group]
        target = tenure.begin_yield()
        if isinstance(target, PendingRelease):
            await self._retry_of_yield(tenure, target)
            return
        session = self.session
        if session is None:
            raise NotHolder(
                f"job {self.job_id} does not hold group {group} (no grant recorded by this client)"
            )
        # A yield cut short by a cancel would leave the group held until the session ends:
        # once started, it runs to completion, bookkeeping included.
        await self._tasks.finish_even_if_cancelled(
            self._yield_grant(tenure, session, target), f"timeslice-yield-{group}"
        )

    async def _retry_of_yield(self, tenure: Tenure, release: PendingRelease) -> None:
        """The job's yield again after one that was not confirmed: done once that release
        is (not after an acquire of the group began: the job is past that hold)."""
        if not release.finished:
            try:
                async with asyncio.timeout(self._call_timeout):
                    await release.wait()
            except TimeoutError:
                raise Unavailable(
                    f"the release of group {tenure.group} by job {self.job_id} is still not "
                    f"confirmed after {release.attempts} tries; it goes on in the background"
                ) from None
        tenure.told(release)
        release.raise_unless_released(self.job_id)

    async def _yield_grant(self, tenure: Tenure, session: Session, grant: Grant) -> None:
        try:
            await self.send_yield(session, tenure.group, grant.epoch)
        except (NotHolder, PermissionDenied):
            # The orchestrator's word: we do not hold it, so our record is stale.
            tenure.yielded(grant)
            raise
        except SessionExpired as exc:
            session.lose(f"Yield: {exc}")
            raise
        except (Unavailable, Timeout):
            # Not confirmed: the hold may still be on the server. The job is done with it
            # either way; the release goes on until the orchestrator answers.
            release = self._release(session, tenure.group, grant.epoch)
            if tenure.release_unconfirmed(grant, release):
                self._start(release)
            raise
        tenure.yielded(grant)

    def _release(self, session: Session, group: str, epoch: int) -> PendingRelease:
        """The release of a hold, sent again until the orchestrator answers (once started)."""

        async def send() -> int:
            return await self.send_yield(session, group, epoch)

        return PendingRelease(group, epoch, session, send)

    def _start(self, release: PendingRelease) -> None:
        self._tasks.spawn(release.run(), f"timeslice-release-{release.group}", kind="release")

    async def send_yield(self, session: Session, group: str, epoch: int) -> int:
        """Send Yield for the hold ``epoch`` of ``group``; returns how many attempts it took."""
        attempts = 0
        request = YieldRequest(
            session_id=session.session_id,
            session_secret=session.secret,
            job_id=self.job_id,
            group_id=group,
            epoch=epoch,
            trace_context=_trace_context.carrier(),
        )

        async def call(stub: TimeSliceStub, timeout: float) -> None:
            nonlocal attempts
            attempts += 1
            await self._yield_streams.send(stub, request, timeout)

        try:
            await self.unary(f"Yield({group})", call)
        except (NotHolder, PermissionDenied):
            # A retried Yield whose first attempt landed (its answer lost) finds the group
            # given back: free (not holder), or already granted to the next job.
            if attempts > 1:
                return attempts
            raise
        return attempts

    # ------------------------------------------------------------------- close

    async def close(self) -> None:
        """End the session (best effort), stop the background tasks, close the streams."""
        self.closed = True
        session, self.session = self.session, None
        self.tenures.drop_grants()
        if session is not None:
            await session.close(budget=min(self._call_timeout, _CLOSE_BUDGET))
        await self._tasks.cancel_all(timeout=1.0)
        await self._yield_streams.close()
        self._transport.close()
