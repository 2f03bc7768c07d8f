"""The asyncio client of the timeslice orchestrator.

A job wraps each accelerator phase of its loop in ``acquire`` / ``yield_`` (or
``on_accelerators``); the orchestrator grants the group's accelerators to one job at a time
and moves device state between jobs while they wait.

The client is put together from small parts:

- :mod:`timeslice._transport`: channels to every replica, unary calls with failover;
- :mod:`timeslice._session`: the session (lease, keepalive, loss, close);
- :mod:`timeslice._acquire`: one acquire call (stream, failover, re-attach, abort);
- :mod:`timeslice._release`: a yield the orchestrator did not confirm in time, retried until
  it does;
- :mod:`timeslice._streams`: the retrying stream both acquire and :meth:`watch` use;
- :mod:`timeslice.runner`: the event loop the client lives on, and blocking use of it.

Sessions: the first ``acquire`` opens a session (an etcd lease on the orchestrator side that
owns the job's queue entries and holds) and a supervised background task keeps it alive every
ttl/3. If the orchestrator says the session expired, everything it held is gone: the client
forgets its grants and opens a new session on the next ``acquire``.

Event loops: the client binds to the first event loop that uses it. Called from another
running loop while its own loop runs in another thread (the way
:class:`timeslice.TimeSliceOrchestratorClient` uses it), each call is submitted to its own
loop and awaited there, so keepalives never depend on the caller's loop being responsive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

from timeslice._acquire import AcquireCall, ProgressCallback
from timeslice._release import PendingRelease
from timeslice._scope import AcceleratorScope
from timeslice._session import Session
from timeslice._streams import Retry, retrying_stream
from timeslice._transport import Transport
from timeslice._types import AcquireProgress, AcquireStage, Grant
from timeslice._validate import check_positive, check_priority, check_seconds
from timeslice._yields import YieldStreams
from timeslice.backoff import Backoff
from timeslice.errors import (
    AlreadyExists,
    Cancelled,
    InvalidArgument,
    NotFound,
    NotHolder,
    PermissionDenied,
    SessionExpired,
    Timeout,
    TimeSliceError,
    Unavailable,
)
from timeslice.ids import validate_group_id, validate_job_id
from timeslice.runner import ClientRunner
from timeslice.targets import Target, targets_from_env
from timeslice.tasks import Supervisor, run_to_completion
from timeslice.tls import client_tls
from timeslice.worker import check_can_enter
from timeslice_proto.timeslice.v1 import (
    AcquireEvent,
    GetGroupStatusRequest,
    GroupEvent,
    GroupStatus,
    GroupSummary,
    KeepAliveResponse,
    QueueEntry,
    TimeSliceStub,
    WatchGroupRequest,
    YieldRequest,
)

__all__ = ["AsyncTimeSliceClient", "ProgressCallback"]

log = logging.getLogger("timeslice")

T = TypeVar("T")

# CloseSession is best effort: the lease expires on its own if the orchestrator is away.
_CLOSE_BUDGET = 3.0
# Pauses between two look-ups for an unseen grant while no replica answers.
_SWEEP_RETRY_INITIAL = 0.1
_SWEEP_RETRY_MAX = 1.0
# Pauses between the looks of a sweep that find nothing to do yet: the replica answering may
# not show yet a grant made a moment ago, nor the server's own withdrawal of the entry (which
# is why the entry is taken back only when it is still there after these).
_SWEEP_PAUSES = (0.05, 0.2)


def rebuild_client(cls: Callable[..., T], settings: dict[str, Any]) -> T:
    """Unpickle a client: a new one from the settings of the pickled one."""
    return cls(**settings)


class _OpenWatch:
    """One running :meth:`AsyncTimeSliceClient.watch`: its connections, on its consumer's loop."""

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


def _entry_of(status: GroupStatus | None, job: str) -> QueueEntry | None:
    if status is None:
        return None
    return next((q for q in status.queue if q.job_id == job), None)


class AsyncTimeSliceClient:
    """asyncio client of the timeslice orchestrator.

    Args:
        target: one ``host:port``, a comma-separated list, or a sequence of them (every
            orchestrator replica answers every call; the client fails over between them).
            ``[v6addr]:port`` and ``unix:/path`` work too; the port defaults to 50051.
            Default: the ``TIMESLICE_TARGET`` environment variable, else ``localhost:50051``.
        job_id: the job this client acts for. Default: ``TIMESLICE_JOB_ID``.
        session_ttl: lease TTL of the session in seconds; keepalives go every ttl/3. Holds
            and queue entries of a client that dies are released about this long after.
        call_timeout: the bound on every unary call, retries and failover included.
        on_yield_request: called with a group id when the orchestrator starts asking this
            job to yield it (see :meth:`yield_requested`).
        tls_ca, tls_cert, tls_key: PEM files: the CA that signed the orchestrators'
            certificates, and this job's client certificate and key (mutual TLS). Default:
            ``TIMESLICE_TLS_CA``, ``TIMESLICE_TLS_CERT``, ``TIMESLICE_TLS_KEY``. Rotated files
            are picked up by the next connection.
        insecure: ``True`` for plaintext (also ``TIMESLICE_INSECURE=1``, or unix targets);
            with neither TLS nor this, the client refuses to start.

    Raises:
        InvalidArgument: no job id, or a malformed id, target or duration; no TLS
            configuration and plaintext not chosen.
    """

    def __init__(
        self,
        target: str | Sequence[str] | None = None,
        *,
        job_id: str | None = None,
        session_ttl: float = 10.0,
        call_timeout: float = 10.0,
        on_yield_request: Callable[[str], None] | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        insecure: bool | None = None,
    ) -> None:
        self._targets: list[Target] = targets_from_env(target)
        # TLS files (or $TIMESLICE_TLS_CA/_CERT/_KEY); plaintext only when chosen: see
        # timeslice.tls. Files are read at the first connection, off the loop.
        self._tls = client_tls(
            self._targets, ca=tls_ca, cert=tls_cert, key=tls_key, insecure=insecure
        )
        if job_id is None:
            job_id = os.environ.get("TIMESLICE_JOB_ID") or None
        if job_id is None:
            raise InvalidArgument(
                "no job id: pass job_id=... or set the TIMESLICE_JOB_ID environment variable"
            )
        self._job_id = validate_job_id(job_id)
        self._session_ttl = check_positive(session_ttl, "session_ttl")
        self._call_timeout = check_positive(call_timeout, "call_timeout")
        self._transport = Transport(self._targets, self._tls)
        # Yields go over one long-lived stream per connection (_yields.py).
        self._yield_streams = YieldStreams()
        self._runner = ClientRunner(
            self._job_id, call_timeout=self._call_timeout, acquire=self._acquire, yield_=self._yield
        )
        self._tasks = Supervisor(f"job {self._job_id}")
        self._session: Session | None = None
        self._session_lock = asyncio.Lock()
        self._grants: dict[str, Grant] = {}
        # Yields not confirmed within call_timeout, still being sent (see timeslice._release);
        # one that ended stays until the job has been told (its retry of the yield returns).
        self._releasing: dict[str, PendingRelease] = {}
        self._acquiring: set[str] = set()
        # After an aborted acquire: the look-up for a grant it was given unseen, per group.
        self._sweeps: dict[str, asyncio.Task[None]] = {}
        self._closed = False
        # Watches run on their consumers' loops, maybe in other threads than close().
        self._watches: set[_OpenWatch] = set()
        self._watches_lock = threading.Lock()
        self._yield_requests: set[str] = set()
        self._on_yield_request = on_yield_request
        self.keepalives_sent = 0
        """KeepAlive calls answered so far (all sessions)."""
        self.last_session_loss: str | None = None
        """Why the last session was lost, if one was."""

    def settings(self) -> dict[str, Any]:
        """The arguments that build a client like this one, resolved (environment defaults,
        TLS files): what a copy in another process is made from."""
        files = self._tls.files if self._tls is not None else None
        return {
            "target": self.targets,
            "job_id": self._job_id,
            "session_ttl": self._session_ttl,
            "call_timeout": self._call_timeout,
            "on_yield_request": self._on_yield_request,
            "tls_ca": files.ca if files is not None else None,
            "tls_cert": files.cert if files is not None else None,
            "tls_key": files.key if files is not None else None,
            "insecure": files is None,
        }

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its settings, not its connection (Ray tasks and actors, multiprocessing):
        the copy opens its own session on its first call. Holds stay with this client; the
        TLS files must exist where the copy runs."""
        return (rebuild_client, (type(self), self.settings()))

    # ----------------------------------------------------------------- properties

    @property
    def job_id(self) -> str:
        """The job this client acts for."""
        return self._job_id

    @property
    def targets(self) -> list[str]:
        """The orchestrator addresses, in failover order."""
        return [str(t) for t in self._targets]

    @property
    def session_id(self) -> str | None:
        """The open session's id, or ``None`` before the first acquire / after a loss."""
        return self._session.session_id if self._session is not None else None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; every later call raises ``Cancelled``."""
        return self._closed

    @property
    def runner(self) -> ClientRunner:
        """Drives this client on its event loop from other loops and from blocking code.

        Used by :class:`~timeslice.TimeSliceOrchestratorClient` and
        :class:`~timeslice.AcceleratorScope`; see :mod:`timeslice.runner`.
        """
        return self._runner

    def grants(self) -> dict[str, Grant]:
        """The groups this client holds by its own record, keyed by group id."""
        return dict(self._grants)

    def yield_requested(self, group_id: str) -> bool:
        """True when the orchestrator asked this job to yield ``group_id`` soon.

        The co-operative "please yield" signal: the job has held the group longer than the
        orchestrator's ``--max-hold`` while others wait. Nothing is taken away by force; a
        long accelerator phase can check this between steps and yield at a good point. It
        is refreshed with every session keepalive (every ttl/3).
        """
        return group_id in self._yield_requests and group_id in self._grants

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(targets={self.targets!r}, job_id={self._job_id!r}, "
            f"session_id={self.session_id!r}, closed={self._closed})"
        )

    # ----------------------------------------------------------------- public API

    async def acquire(
        self,
        group_id: str,
        *,
        timeout: float | None = None,
        priority: int = 0,
        on_progress: ProgressCallback | None = None,
    ) -> Grant:
        """Wait until this job holds ``group_id`` and return the :class:`Grant`.

        Args:
            group_id: the accelerator group.
            timeout: seconds to wait in all; ``None`` waits as long as it takes.
            priority: larger runs first under the priority policy (ignored by FIFO).
            on_progress: called with each :class:`AcquireProgress` (queue position,
                switching, granted) on the client's event loop; an exception it raises
                aborts the acquire.

        If a yield of the group could not be confirmed (the orchestrator or etcd was away),
        the client first waits for that release to land, within ``timeout``, and then
        acquires as usual: at once when nobody else waits.

        Raises:
            Timeout: not granted within ``timeout``; the queue entry was removed.
            AlreadyExists: this client already holds the group or is acquiring it.
            GroupFaulted: the switch to this job failed for good.
            FailedPrecondition: this process registered the job's state with its node agent
                in another group (:func:`timeslice.worker.check_can_enter`); nothing is sent.
            Unavailable: no orchestrator replica could be reached.

        Cancel-safe: if the awaiting task is cancelled or the timeout passes, the Acquire
        stream is cancelled, so the orchestrator drops the queue entry; a grant that was
        already received is given back before the error propagates.
        """
        return await self._runner.acquire(
            group_id, timeout=timeout, priority=priority, on_progress=on_progress
        )

    async def yield_(self, group_id: str) -> None:
        """Give ``group_id`` back. Lazy on the server: nothing moves unless another job waits.

        The call retries within ``call_timeout``. If no replica confirmed the release by then,
        it raises :class:`Unavailable` (or :class:`Timeout`) and the client stops using the
        grant but keeps sending the release in the background until the orchestrator answers
        (or the session ends), so the group is not left held. A later ``acquire`` of the
        group waits for that release first; calling ``yield_`` again (the job's retry) waits
        for it too, or returns at once if it has already landed: once, not after an
        ``acquire`` of the group began.

        Raises:
            NotHolder: this client holds no grant for the group (checked locally, no call
                is made), or the orchestrator says the grant is no longer valid.
            PermissionDenied: another job holds the group.
            Unavailable: the release was not confirmed within ``call_timeout``; it goes on
                in the background.
        """
        await self._runner.yield_(group_id)

    release = yield_

    async def acquire_all(
        self, group_ids: Sequence[str], *, timeout: float | None = None, priority: int = 0
    ) -> dict[str, Grant]:
        """Hold every group in ``group_ids`` at once (a sync job needing trainer and samplers).

        Groups are acquired one by one in one global order (sorted by id), the classic rule
        that makes waiting deadlock-free: two jobs can never each hold a group the other waits
        for. All or nothing: on a timeout, error or cancellation, the groups already held are
        yielded before the error propagates, even if the caller is cancelled meanwhile (a
        yield the orchestrator does not confirm goes on in the background, as with
        :meth:`yield_`). ``timeout`` bounds the wait for the groups; the rollback may take up
        to ``call_timeout`` more per group held.
        """
        groups = sorted({validate_group_id(g) for g in group_ids})
        if not groups:
            raise InvalidArgument("acquire_all needs at least one group")
        for group in groups:
            # All of them before the first is taken: none is held and given back in vain.
            check_can_enter(self._job_id, group)
        wait = check_seconds(timeout, "timeout", allow_none=True)
        loop = asyncio.get_running_loop()
        deadline = None if wait is None else loop.time() + wait
        held: dict[str, Grant] = {}
        try:
            for group in groups:
                left = None if deadline is None else max(0.001, deadline - loop.time())
                held[group] = await self.acquire(group, timeout=left, priority=priority)
        except BaseException:
            # A cancel that lands in the rollback (a blocking caller's deadline, Ctrl-C) must
            # not stop it halfway, leaving held the groups the caller is told were given back;
            # each yield is bounded by call_timeout, so the rollback is too.
            await run_to_completion(self._roll_back(list(held)))
            raise
        return held

    async def _roll_back(self, groups: list[str]) -> None:
        """Yield what a failed acquire_all holds; its failures are logged, not raised, so that
        the caller learns why the acquire failed."""
        try:
            await self.yield_all(groups)
        except TimeSliceError as exc:
            log.warning(
                "rollback of acquire_all by job %s: not every yield was confirmed (%s); "
                "their releases go on in the background",
                self._job_id,
                exc,
            )

    async def yield_all(self, group_ids: Sequence[str]) -> None:
        """Yield every group in ``group_ids`` (reverse order); errors are raised after all."""
        errors: list[TimeSliceError] = []
        for group in sorted(group_ids, reverse=True):
            try:
                await self.yield_(group)
            except TimeSliceError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def on_accelerators(
        self, group_id: str, *, timeout: float | None = None, priority: int = 0
    ) -> AcceleratorScope:
        """Hold ``group_id`` around a function or block; see :class:`AcceleratorScope`.

        Works as a decorator on plain and ``async`` functions and as ``async with``. As a
        plain ``with`` (or on a plain function) it blocks, which needs this client's loop to
        run in another thread (use :class:`TimeSliceOrchestratorClient` in synchronous code).
        """
        group = validate_group_id(group_id)
        wait = check_seconds(timeout, "timeout", allow_none=True)
        return AcceleratorScope(self._runner, group, wait, check_priority(priority), owner=self)

    async def status(self, group_id: str) -> GroupStatus:
        """The group's holder, queue, residency, switch in flight and faults."""
        group = validate_group_id(group_id)
        return await self._runner.run(self._group_status(group))

    async def groups(self) -> list[GroupSummary]:
        """One summary per known group."""

        async def call(stub: TimeSliceStub, timeout: float) -> list[GroupSummary]:
            return list((await stub.list_groups(timeout=timeout)).groups)

        return await self._runner.run(self._unary("ListGroups", call))

    async def watch(self, group_id: str) -> AsyncGenerator[GroupEvent, None]:
        """Yield the group's status every time it changes, until the server ends the stream.

        Each event carries the whole status, so after a failover to another replica (done
        transparently) consumers just keep the latest. Raises :class:`Unavailable` when no
        replica answers for ``call_timeout``. Close the iterator (``aclosing``, or leave
        the ``async for``) to cancel the stream.

        Raises:
            Cancelled: the client was closed: :meth:`close` ends every open watch, as it
                does a waiting acquire, and closes its connections.
        """
        group = validate_group_id(group_id)
        self._check_open()
        # Watches need no session: they get their own channels on the caller's loop, so they
        # work from any loop and never compete with acquire for a connection.
        transport = Transport(self._targets, self._tls)

        def open_stream(target: Target, stub: TimeSliceStub) -> AsyncGenerator[GroupEvent, None]:
            request = WatchGroupRequest(group_id=group)
            return cast(AsyncGenerator[GroupEvent, None], stub.watch_group(request))

        def on_failure(exc: Exception, error: TimeSliceError | None) -> Retry | None:
            if self._closed or not isinstance(error, Unavailable):
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
        with self._watches_lock:
            self._watches.add(watch)
        try:
            # close() may have run in another thread since the check above, and not seen us.
            self._check_open()
            async with contextlib.aclosing(events):
                while True:
                    try:
                        event = await anext(events)
                    except StopAsyncIteration:
                        return
                    except Exception as exc:
                        if self._closed:
                            # Whatever broke, it was close() cutting the connections.
                            raise self._watch_closed(group) from exc
                        raise
                    if self._closed:
                        # Read before the close, given after it: the watch has ended.
                        raise self._watch_closed(group)
                    yield event
        finally:
            with self._watches_lock:
                self._watches.discard(watch)
            transport.close()

    async def close(self) -> None:
        """End the session (CloseSession, best effort) and close the connections.

        Everything the session held is released by the orchestrator. A waiting acquire and
        every open :meth:`watch` raise :class:`Cancelled`. Idempotent.
        """
        if self._closed:
            return
        await self._runner.run(self._close())

    async def __aenter__(self) -> AsyncTimeSliceClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ------------------------------------------------------------------ internal

    def _check_open(self) -> None:
        if self._closed:
            raise Cancelled(f"the timeslice client of job {self._job_id} was closed")

    def _watch_closed(self, group: str) -> Cancelled:
        return Cancelled(
            f"the timeslice client of job {self._job_id} was closed while watching {group}"
        )

    async def _unary(self, what: str, call: Callable[[TimeSliceStub, float], Awaitable[T]]) -> T:
        self._check_open()
        return await self._transport.unary(what, call, budget=self._call_timeout)

    # ------------------------------------------------------------------ sessions

    async def _group_status(self, group: str) -> GroupStatus:
        async def call(stub: TimeSliceStub, timeout: float) -> GroupStatus:
            request = GetGroupStatusRequest(group_id=group)
            return await stub.get_group_status(request, timeout=timeout)

        return await self._unary(f"GetGroupStatus({group})", call)

    async def _ensure_session(self) -> Session:
        async with self._session_lock:
            if self._session is not None:
                return self._session
            self._check_open()
            session = await Session.open(
                self._transport,
                job_id=self._job_id,
                ttl=self._session_ttl,
                call_timeout=self._call_timeout,
                on_keepalive=self._on_keepalive,
                on_lost=self._on_session_lost,
            )
            self._session = session
            session.keep_alive(self._tasks.spawn)
            log.debug(
                "job %s opened session %s (ttl %.3gs)",
                self._job_id,
                session.session_id,
                session.ttl,
            )
            return session

    def _on_keepalive(self, reply: KeepAliveResponse) -> None:
        self.keepalives_sent += 1
        groups = set(reply.yield_requested)
        for group in groups - self._yield_requests:
            log.info("the orchestrator asks job %s to yield %s", self._job_id, group)
            if self._on_yield_request is not None:
                self._on_yield_request(group)
        self._yield_requests = groups

    def _on_session_lost(self, session: Session, reason: str) -> None:
        if self._session is not session:
            return
        self._session = None
        self.last_session_loss = reason
        lost = sorted(self._grants)
        self._grants.clear()
        for pending in self._releasing.values():
            if pending.session is session:
                pending.wake()  # its hold went with the session: nothing left to release
        log.warning(
            "session %s of job %s is gone (%s); holds released: %s; a new session opens on "
            "the next acquire",
            session.session_id,
            self._job_id,
            reason,
            ", ".join(lost) or "none",
        )

    # ------------------------------------------------------------------- acquire

    async def _acquire(
        self,
        group: str,
        timeout: float | None,
        priority: int,
        on_progress: ProgressCallback | None,
    ) -> Grant:
        self._check_open()
        # Before anything is sent: the process could not serve the phase.
        check_can_enter(self._job_id, group)
        held = self._grants.get(group)
        if held is not None:
            raise AlreadyExists(
                f"job {self._job_id} already holds group {group} (epoch {held.epoch}); "
                "yield it first"
            )
        if group in self._acquiring:
            raise AlreadyExists(
                f"an acquire of group {group} by job {self._job_id} is already in progress "
                "in this client"
            )
        self._acquiring.add(group)
        pending = self._pending_release(group)
        # A yield from now on is of the hold this acquire gets, not of the one released earlier.
        self._answer_release(group)
        sweep = self._sweeps.get(group)
        call = AcquireCall(
            self._transport,
            job_id=self._job_id,
            group=group,
            priority=priority,
            on_progress=on_progress,
            open_session=self._ensure_session,
            check_open=self._check_open,
            closed=lambda: self._closed,
        )
        loop = asyncio.get_running_loop()
        try:
            deadline = None if timeout is None else loop.time() + timeout
            limit = asyncio.timeout_at(deadline)
            try:
                async with limit:
                    if pending is not None:
                        # Our own yield of the group is still on its way: let it land first
                        # (now, not after its backoff), then queue as anyone would.
                        await pending.wait()
                    if sweep is not None:
                        # An earlier acquire of the group was aborted: a grant it may have
                        # been given unseen goes back first, or this one meets it.
                        await asyncio.wait((sweep,))
                    await call.until_granted()
                    # The stream's end follows GRANTED: read it without making the job wait.
                    self._tasks.spawn(
                        call.finish(self._call_timeout),
                        f"timeslice-acquire-end-{group}",
                        kind="acquire end",
                    )
            except TimeoutError:
                if limit.expired():
                    raise Timeout(
                        f"job {self._job_id} was not granted group {group} within {timeout:g}s"
                    ) from None
                raise
            granted, session = call.granted, call.session
            assert granted is not None and session is not None
            if session is not self._session:
                raise SessionExpired(
                    f"the session of job {self._job_id} was lost right after group {group} "
                    f"was granted ({self.last_session_loss})"
                )
            if on_progress is not None:
                on_progress(AcquireProgress(AcquireStage.GRANTED, 0))
            grant = Grant.from_event(group, self._job_id, granted)
            self._grants[group] = grant
            return grant
        except BaseException:
            session = call.session
            if session is not None and session is self._session:
                if call.granted is not None:
                    await self._give_back_raced(group, session, call.granted.epoch)
                elif call.sent and not session.done:
                    self._sweep_later(session, call)
            raise
        finally:
            self._acquiring.discard(group)

    async def _give_back_raced(self, group: str, session: Session, epoch: int) -> None:
        """Yield a grant that arrived while its acquire was being aborted."""
        log.info("acquire of %s aborted after the grant (epoch %d); yielding it", group, epoch)
        try:
            await self._tasks.finish_even_if_cancelled(
                self._send_yield(session, group, epoch), f"timeslice-yield-{group}"
            )
        except (Unavailable, Timeout) as exc:
            # Not confirmed: keep sending it, as for a yield (the grant must not stay held).
            log.warning("give-back of %s (epoch %d) not confirmed yet: %s", group, epoch, exc)
            if not self._closed and not session.done:
                # The job never learned of this grant: a yield of the group is not its retry.
                self._release_later(session, group, epoch, answered=True)
        except Exception as exc:
            # The acquire's own error is what propagates; this one must still be seen.
            log.error(
                "could not give back group %s (epoch %d) after an aborted acquire: %s",
                group,
                epoch,
                exc,
            )

    def _sweep_later(self, session: Session, aborted: AcquireCall) -> None:
        group = aborted.group
        task = self._tasks.spawn(
            self._sweep(session, aborted), f"timeslice-sweep-{group}", kind="sweep"
        )
        self._sweeps[group] = task

        def finished(_: asyncio.Task[None]) -> None:
            if self._sweeps.get(group) is task:
                del self._sweeps[group]

        task.add_done_callback(finished)

    async def _sweep(self, session: Session, aborted: AcquireCall) -> None:
        """Take back what an aborted acquire left on the server: a grant it never saw, or its
        queue entry.

        The abort resets the Acquire stream, and the orchestrator withdraws the entry, or
        takes back a grant it could not deliver. Two cases escape it:

        - The server had already sent GRANTED and ended the stream: the reset comes too late,
          and the GRANTED, still on the wire, is dropped with the stream.
        - The entry outlived the call: the abort came while no stream was open (between
          two replicas, both unreachable for a moment). That entry is granted later.

        Either way a hold would sit on our live session with no record here: the group
        blocked for everyone, our next acquire of it refused ("already holds"). So the client
        looks the group up. A hold of this job is yielded (the Yield names our session and
        the epoch read: it cannot release anyone else's hold). The aborted call's own entry
        (its ticket), still there after the server had time to withdraw it, is taken back:
        the same request, sent again, re-attaches to it and is reset at its first answer,
        which withdraws it; then the group is looked at again, for a grant that raced that
        reset. The replica answering may lag a grant or a withdrawal by a moment, so looks
        that find nothing to do are repeated a few times, briefly. Retried while no replica
        answers, until the session ends (which takes everything anyway).
        """
        group = aborted.group
        backoff = Backoff(_SWEEP_RETRY_INITIAL, _SWEEP_RETRY_MAX)
        pauses = list(_SWEEP_PAUSES)
        while not session.done and not self._closed and group not in self._grants:
            try:
                try:
                    status: GroupStatus | None = await self._group_status(group)
                except NotFound:
                    status = None  # not (yet) known to the replica that answered
                if status is not None and status.holder_job_id == self._job_id:
                    epoch = status.holder_epoch
                    await self._send_yield(session, group, epoch)
                    log.warning(
                        "gave back group %s (epoch %d): it was granted to an acquire of job "
                        "%s that was aborted",
                        group,
                        epoch,
                        self._job_id,
                    )
                    return
                entry = _entry_of(status, self._job_id)
                mine = entry is not None and aborted.ticket in (0, entry.revision)
                if mine and not pauses:
                    epoch = await self._leave_queue(session, aborted)
                    if epoch:
                        await self._send_yield(session, group, epoch)
                        return
                    pauses = [_SWEEP_PAUSES[0]]  # a grant may have raced the reset: look again
                    continue
                if not pauses:
                    return  # nothing of the aborted call's is left
                await asyncio.sleep(pauses.pop(0))
            except (NotHolder, PermissionDenied, NotFound, AlreadyExists, Cancelled) as exc:
                # Not ours (another session of the job), gone, or the client closed.
                log.debug("sweep of %s ends: %s", group, exc)
                return
            except SessionExpired as exc:
                session.lose(f"sweep: {exc}")
                return
            except (Unavailable, Timeout) as exc:
                log.warning(
                    "taking back what an aborted acquire of %s left, retrying: %s", group, exc
                )
                await asyncio.sleep(backoff.next_delay())
            except TimeSliceError as exc:
                # Not something a retry fixes (a faulted group, a quota): the session's end
                # takes what is left.
                log.warning(
                    "could not take back what an aborted acquire of %s left: %s", group, exc
                )
                return

    async def _leave_queue(self, session: Session, aborted: AcquireCall) -> int:
        """Re-send the aborted request (it re-attaches to its entry) and reset it at the first
        answer, which makes the orchestrator withdraw the entry. Returns the epoch when that
        answer was a grant (given back by the caller), else 0."""
        request = aborted.request(session)

        async def call(stub: TimeSliceStub, timeout: float) -> int:
            events = cast(AsyncGenerator[AcquireEvent, None], stub.acquire(request))
            async with contextlib.aclosing(events), asyncio.timeout(timeout):
                event = await anext(events, None)
            if event is None:
                return 0  # ended without an answer: nothing was written for it
            granted = AcquireStage.from_wire(event.state) is AcquireStage.GRANTED
            return int(event.epoch) if granted else 0

        return await self._unary(f"Acquire({aborted.group}) to leave its queue", call)

    # --------------------------------------------------------------------- yield

    async def _send_yield(self, session: Session, group: str, epoch: int) -> int:
        """Send Yield; returns how many attempts it took."""
        attempts = 0
        request = YieldRequest(
            session_id=session.session_id,
            session_secret=session.secret,
            job_id=self._job_id,
            group_id=group,
            epoch=epoch,
        )

        async def call(stub: TimeSliceStub, timeout: float) -> None:
            nonlocal attempts
            attempts += 1
            await self._yield_streams.send(stub, request, timeout)

        try:
            await self._unary(f"Yield({group})", call)
        except (NotHolder, PermissionDenied):
            # A retried Yield whose first attempt landed (its answer lost) finds the group
            # given back: free (not holder), or already granted to the next job.
            if attempts > 1:
                return attempts
            raise
        return attempts

    async def _yield(self, group: str) -> None:
        self._check_open()
        pending = self._pending_release(group)
        if pending is not None and not pending.answered and group not in self._grants:
            # A yield again after one that was not confirmed: done once that release is.
            # (Not after an acquire of the group began: the job is past that hold.)
            try:
                async with asyncio.timeout(self._call_timeout):
                    await pending.wait()
            except TimeoutError:
                raise Unavailable(
                    f"the release of group {group} by job {self._job_id} is still not "
                    f"confirmed after {pending.attempts} tries; it goes on in the background"
                ) from None
            self._answer_release(group)
            pending.raise_unless_released(self._job_id)
            return
        listed = self._releasing.get(group)
        if listed is not None and not listed.answered and group not in self._grants:
            # The same, when that release has already ended: the retry is answered once.
            self._answer_release(group)
            listed.raise_unless_released(self._job_id)
            return
        grant = self._grants.get(group)
        session = self._session
        if grant is None or session is None:
            raise NotHolder(
                f"job {self._job_id} does not hold group {group} (no grant recorded by this client)"
            )
        # A yield cut short by a cancel would leave the group held until the session ends:
        # once started, it runs to completion, bookkeeping included.
        await self._tasks.finish_even_if_cancelled(
            self._yield_and_forget(session, group, grant), f"timeslice-yield-{group}"
        )

    async def _yield_and_forget(self, session: Session, group: str, grant: Grant) -> None:
        try:
            await self._send_yield(session, group, grant.epoch)
        except (NotHolder, PermissionDenied):
            # The orchestrator's word: we do not hold it, so our record is stale.
            self._forget(group, grant)
            raise
        except SessionExpired as exc:
            session.lose(f"Yield: {exc}")
            raise
        except (Unavailable, Timeout):
            # Not confirmed: the hold may still be on the server. The job is done with it
            # either way; the release goes on until the orchestrator answers.
            self._forget(group, grant)
            self._release_later(session, group, grant.epoch)
            raise
        self._forget(group, grant)

    def _pending_release(self, group: str) -> PendingRelease | None:
        pending = self._releasing.get(group)
        # One that ended stays listed until the job is told of it (see _answer_release).
        return pending if pending is not None and not pending.finished else None

    def _answer_release(self, group: str) -> None:
        """The job has been told of the group's background release (it acquired the group
        again, or its retry of the yield returned): no later yield is that retry."""
        listed = self._releasing.get(group)
        if listed is not None:
            listed.answered = True
            if listed.finished:
                del self._releasing[group]

    def _release_later(
        self, session: Session, group: str, epoch: int, *, answered: bool = False
    ) -> None:
        async def send() -> int:
            return await self._send_yield(session, group, epoch)

        pending = PendingRelease(group, epoch, session, send)
        pending.answered = answered
        self._releasing[group] = pending
        task = self._tasks.spawn(pending.run(), f"timeslice-release-{group}", kind="release")

        def finished(_: asyncio.Task[None]) -> None:
            if self._releasing.get(group) is pending and pending.answered:
                del self._releasing[group]

        task.add_done_callback(finished)

    def _forget(self, group: str, grant: Grant) -> None:
        if self._grants.get(group) is grant:
            del self._grants[group]

    # --------------------------------------------------------------------- close

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._watches_lock:
            watches = list(self._watches)
        for watch in watches:
            watch.end()
        session, self._session = self._session, None
        self._grants.clear()
        if session is not None:
            await session.close(budget=min(self._call_timeout, _CLOSE_BUDGET))
        await self._tasks.cancel_all(timeout=1.0)
        await self._yield_streams.close()
        self._transport.close()
