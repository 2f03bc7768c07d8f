"""The asyncio client of the timeslice orchestrator.

A job wraps each accelerator phase of its loop in ``acquire`` / ``yield_`` (or
``on_accelerators``); the orchestrator grants the group's accelerators to one job at a time
and moves device state between jobs while they wait.

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
import math
import os
import socket
import uuid
from collections.abc import AsyncGenerator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar, cast

from grpclib.client import Stream
from grpclib.const import Cardinality
from grpclib.exceptions import StreamTerminatedError

from timeslice._loops import call_in_loop, current_loop
from timeslice._scope import AcceleratorScope
from timeslice._transport import (
    DEFAULT_TARGET,
    Backoff,
    Target,
    Transport,
    check_seconds,
    map_error,
    parse_targets,
)
from timeslice._types import AcquireProgress, AcquireStage, Grant
from timeslice.errors import (
    AlreadyExists,
    Cancelled,
    InternalError,
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
from timeslice_proto.timeslice.v1 import (
    AcquireEvent,
    AcquireRequest,
    CloseSessionRequest,
    GetGroupStatusRequest,
    GroupEvent,
    GroupStatus,
    GroupSummary,
    KeepAliveRequest,
    KeepAliveResponse,
    OpenSessionRequest,
    TimeSliceStub,
    WatchGroupRequest,
    YieldRequest,
)

log = logging.getLogger("timeslice")

T = TypeVar("T")

ProgressCallback = Callable[[AcquireProgress], None]

_ACQUIRE_METHOD = "/timeslice.v1.TimeSlice/Acquire"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# How long an aborted acquire looks at what the server already sent, to catch a GRANTED that
# raced the abort (it is in our receive buffer, so this never waits on the network for long).
_DRAIN_SECONDS = 0.02
# CloseSession is best effort: the lease expires on its own if the orchestrator is away.
_CLOSE_BUDGET = 3.0


def _check_priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"priority must be an int, got {type(value).__name__}")
    if not _INT32_MIN <= value <= _INT32_MAX:
        raise InvalidArgument(f"priority {value} is outside the int32 range")
    return value


def _check_positive(value: object, what: str) -> float:
    seconds = check_seconds(value, what)
    assert seconds is not None
    if seconds <= 0:
        raise InvalidArgument(f"{what} must be > 0, got {value!r}")
    return seconds


@dataclass(eq=False)
class _Session:
    session_id: str
    ttl: float  # seconds the keepalive cadence is based on


@dataclass(eq=False)
class _AcquireOutcome:
    """What one acquire call learned so far; read by its cleanup path."""

    session: _Session | None = None
    granted: AcquireEvent | None = None
    events: int = 0
    # Sent with every attempt of this acquire so the server can recognise a retry.
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


class AsyncTimeSliceClient:
    """asyncio client of the timeslice orchestrator.

    Args:
        target: one ``host:port``, a comma-separated list, or a sequence of them (every
            orchestrator replica answers every call; the client fails over between them).
            Default: the ``TIMESLICE_TARGET`` environment variable, else ``localhost:50051``.
        job_id: the job this client acts for. Default: ``TIMESLICE_JOB_ID``.
        session_ttl: lease TTL of the session in seconds; keepalives go every ttl/3. Holds
            and queue entries of a client that dies are released about this long after.
        call_timeout: the bound on every unary call, retries and failover included.

    Raises:
        InvalidArgument: no job id, or a malformed id, target or duration.
    """

    def __init__(
        self,
        target: str | Sequence[str] | None = None,
        *,
        job_id: str | None = None,
        session_ttl: float = 10.0,
        call_timeout: float = 10.0,
        on_yield_request: Callable[[str], None] | None = None,
    ) -> None:
        if target is None:
            target = os.environ.get("TIMESLICE_TARGET") or DEFAULT_TARGET
        self._targets = parse_targets(target)
        if job_id is None:
            job_id = os.environ.get("TIMESLICE_JOB_ID") or None
        if job_id is None:
            raise InvalidArgument(
                "no job id: pass job_id=... or set the TIMESLICE_JOB_ID environment variable"
            )
        self._job_id = validate_job_id(job_id)
        self._session_ttl = _check_positive(session_ttl, "session_ttl")
        self._call_timeout = _check_positive(call_timeout, "call_timeout")
        self._transport = Transport(self._targets)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: _Session | None = None
        self._session_lock = asyncio.Lock()
        self._keepalive: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._grants: dict[str, Grant] = {}
        self._acquiring: set[str] = set()
        self._closed = False
        self._yield_requests: set[str] = set()
        self._on_yield_request = on_yield_request
        self.keepalives_sent = 0
        """KeepAlive calls answered so far (all sessions)."""
        self.last_session_loss: str | None = None
        """Why the last session was lost, if one was."""

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

    def _note_yield_requests(self, groups: set[str]) -> None:
        for group in groups - self._yield_requests:
            log.info("the orchestrator asks job %s to yield %s", self._job_id, group)
            if self._on_yield_request is not None:
                self._on_yield_request(group)
        self._yield_requests = groups

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

        Raises:
            Timeout: not granted within ``timeout``; the queue entry was removed.
            AlreadyExists: this client already holds the group or is acquiring it.
            GroupFaulted: the switch to this job failed for good.
            Unavailable: no orchestrator replica could be reached.

        Cancel-safe: if the awaiting task is cancelled or the timeout passes, the Acquire
        stream is cancelled, so the orchestrator drops the queue entry; a grant that was
        already received is given back before the error propagates.
        """
        group = validate_group_id(group_id)
        wait = check_seconds(timeout, "timeout", allow_none=True)
        prio = _check_priority(priority)
        if on_progress is not None and not callable(on_progress):
            raise InvalidArgument("on_progress must be callable")
        return await self._on_own_loop(self._acquire(group, wait, prio, on_progress))

    async def yield_(self, group_id: str) -> None:
        """Give ``group_id`` back. Lazy on the server: nothing moves unless another job waits.

        Raises:
            NotHolder: this client holds no grant for the group (checked locally, no call
                is made), or the orchestrator says the grant is no longer valid.
            PermissionDenied: another job holds the group.
        """
        group = validate_group_id(group_id)
        await self._on_own_loop(self._yield(group))

    release = yield_

    async def acquire_all(
        self, group_ids: Sequence[str], *, timeout: float | None = None, priority: int = 0
    ) -> dict[str, Grant]:
        """Hold every group in ``group_ids`` at once (a sync job needing trainer and samplers).

        Groups are acquired one by one in one global order (sorted by id), the classic rule
        that makes waiting deadlock-free: two jobs can never each hold a group the other waits
        for. All or nothing: on a timeout or error, the groups already held are yielded
        before the error propagates. ``timeout`` bounds the whole call.
        """
        groups = sorted({validate_group_id(g) for g in group_ids})
        if not groups:
            raise InvalidArgument("acquire_all needs at least one group")
        wait = check_seconds(timeout, "timeout", allow_none=True)
        loop = asyncio.get_running_loop()
        deadline = None if wait is None else loop.time() + wait
        held: dict[str, Grant] = {}
        try:
            for group in groups:
                left = None if deadline is None else max(0.001, deadline - loop.time())
                held[group] = await self.acquire(group, timeout=left, priority=priority)
        except BaseException:
            await self.yield_all(list(held))
            raise
        return held

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
        return AcceleratorScope(self, group, wait, _check_priority(priority))

    async def status(self, group_id: str) -> GroupStatus:
        """The group's holder, queue, residency, switch in flight and faults."""
        group = validate_group_id(group_id)

        async def call(stub: TimeSliceStub, timeout: float) -> GroupStatus:
            request = GetGroupStatusRequest(group_id=group)
            return await stub.get_group_status(request, timeout=timeout)

        return await self._on_own_loop(self._unary(f"GetGroupStatus({group})", call))

    async def groups(self) -> list[GroupSummary]:
        """One summary per known group."""

        async def call(stub: TimeSliceStub, timeout: float) -> list[GroupSummary]:
            return list((await stub.list_groups(timeout=timeout)).groups)

        return await self._on_own_loop(self._unary("ListGroups", call))

    async def watch(self, group_id: str) -> AsyncGenerator[GroupEvent, None]:
        """Yield the group's status every time it changes, until the server ends the stream.

        Each event carries the whole status, so after a failover to another replica (done
        transparently) consumers just keep the latest. Raises :class:`Unavailable` when no
        replica answers for ``call_timeout``. Close the iterator (``aclosing``, or leave
        the ``async for``) to cancel the stream.
        """
        group = validate_group_id(group_id)
        self._check_open()
        # Watches need no session: they get their own channels on the caller's loop, so they
        # work from any loop and never compete with acquire for a connection.
        transport = Transport(self._targets)
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        down_since: float | None = None
        try:
            while True:
                target, stub = transport.stub()
                try:
                    # The generated stub is an async generator; aclosing resets the stream
                    # as soon as our consumer stops.
                    stream = cast(
                        AsyncGenerator[GroupEvent, None],
                        stub.watch_group(WatchGroupRequest(group_id=group)),
                    )
                    async with contextlib.aclosing(stream) as events:
                        async for event in events:
                            backoff.reset()
                            down_since = None
                            yield event
                    return
                except Exception as exc:
                    error = map_error(exc, f"WatchGroup({group}) via {target}")
                    if error is None:
                        raise
                    if not isinstance(error, Unavailable) or self._closed:
                        raise error from exc
                    now = loop.time()
                    down_since = now if down_since is None else down_since
                    if now - down_since > self._call_timeout:
                        raise error from exc
                    transport.rotate()
                    await asyncio.sleep(backoff.next_delay())
        finally:
            transport.close()

    async def close(self) -> None:
        """End the session (CloseSession, best effort) and close the connections.

        Everything the session held is released by the orchestrator. Idempotent.
        """
        if self._closed:
            return
        await self._on_own_loop(self._close())

    async def __aenter__(self) -> AsyncTimeSliceClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # ----------------------------------------------------------- scope runner hooks

    def _acquire_blocking(self, group_id: str, timeout: float | None, priority: int) -> Grant:
        """Blocking acquire for :class:`AcceleratorScope` (needs the loop in another thread)."""
        return self._run_blocking(
            self._acquire(group_id, timeout, priority, None),
            wait=None if timeout is None else timeout + self._call_timeout + 1.0,
            what=f"acquire({group_id})",
        )

    def _yield_blocking(self, group_id: str) -> None:
        """Blocking yield for :class:`AcceleratorScope`."""
        self._run_blocking(
            self._yield(group_id),
            wait=self._call_timeout + 1.0,
            what=f"yield({group_id})",
        )

    async def _acquire_awaitable(
        self, group_id: str, timeout: float | None, priority: int
    ) -> Grant:
        """Awaitable acquire for :class:`AcceleratorScope`."""
        return await self._on_own_loop(self._acquire(group_id, timeout, priority, None))

    async def _yield_awaitable(self, group_id: str) -> None:
        """Awaitable yield for :class:`AcceleratorScope`."""
        await self._on_own_loop(self._yield(group_id))

    # ------------------------------------------------------------- loop plumbing

    def _bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not None and self._loop is not loop:
            raise InvalidArgument("this client is already bound to another event loop")
        self._loop = loop

    def _own_loop_here(self) -> bool:
        """True when the running loop is this client's loop (binding it on first use)."""
        running = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = running
        if self._loop is running:
            return True
        if self._loop.is_running() and not self._loop.is_closed():
            return False
        raise InvalidArgument(
            "this client is bound to an event loop that is no longer running; "
            "create one client per event loop"
        )

    async def _on_own_loop(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            here = self._own_loop_here()
        except BaseException:
            coro.close()
            raise
        if here:
            return await coro
        assert self._loop is not None
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def _run_blocking(self, coro: Coroutine[Any, Any, T], *, wait: float | None, what: str) -> T:
        loop = self._loop
        problem: str | None = None
        if loop is None or not loop.is_running():
            problem = (
                "blocking use of AsyncTimeSliceClient needs its event loop running in another "
                "thread; use TimeSliceOrchestratorClient in synchronous code, or "
                "`async with client.on_accelerators(...)` / an async function"
            )
        elif current_loop() is loop:
            problem = (
                "this would block the event loop the client runs on; use "
                "`async with client.on_accelerators(...)` or decorate an async function"
            )
        if problem is not None:
            coro.close()
            raise InvalidArgument(problem)
        assert loop is not None
        return call_in_loop(loop, coro, wait=wait, grace=self._call_timeout, what=what)

    def _check_open(self) -> None:
        if self._closed:
            raise Cancelled(f"the timeslice client of job {self._job_id} was closed")

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Start a supervised background task: its failure is logged, never dropped."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    async def _finish_even_if_cancelled(self, coro: Coroutine[Any, Any, T], name: str) -> T:
        """Await ``coro`` in its own task that a cancel of the caller does not stop.

        If the caller is cancelled, the task carries on and its failure, which nobody awaits
        any more, is logged.
        """
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                task.add_done_callback(self._task_done)
            raise

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error(
                "background task %s of job %s failed", task.get_name(), self._job_id, exc_info=exc
            )

    # ------------------------------------------------------------------ sessions

    async def _unary(
        self,
        what: str,
        call: Callable[[TimeSliceStub, float], Coroutine[Any, Any, T]],
        *,
        budget: float | None = None,
    ) -> T:
        self._check_open()
        return await self._transport.unary(
            what, call, budget=self._call_timeout if budget is None else budget
        )

    async def _ensure_session(self) -> _Session:
        async with self._session_lock:
            if self._session is not None:
                return self._session
            self._check_open()
            request = OpenSessionRequest(
                job_id=self._job_id,
                # The wire carries whole seconds; never round a short TTL down to 0 (= default).
                ttl_seconds=max(1, math.ceil(self._session_ttl)),
                client_host=socket.gethostname(),
                client_pid=os.getpid(),
            )

            async def call(stub: TimeSliceStub, timeout: float) -> Any:
                return await stub.open_session(request, timeout=timeout)

            response = await self._unary("OpenSession", call)
            if not response.session_id:
                raise InternalError("OpenSession returned an empty session id")
            granted_ttl = float(response.ttl_seconds) or self._session_ttl
            # Keep alive at the shorter of the two TTLs: more often than needed is harmless.
            session = _Session(
                session_id=response.session_id,
                ttl=min(self._session_ttl, granted_ttl),
            )
            self._session = session
            self._keepalive = self._spawn(
                self._keepalive_guard(session), name=f"timeslice-keepalive-{session.session_id}"
            )
            log.debug(
                "job %s opened session %s (ttl %.3gs)",
                self._job_id,
                session.session_id,
                session.ttl,
            )
            return session

    async def _keepalive_guard(self, session: _Session) -> None:
        try:
            await self._keepalive_loop(session)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # Without keepalives the lease will expire: say so now instead of later.
            log.exception("keepalive of session %s crashed", session.session_id)
            self._session_lost(session, f"keepalive task crashed: {exc!r}")

    async def _keepalive_loop(self, session: _Session) -> None:
        loop = asyncio.get_running_loop()
        interval = session.ttl / 3
        next_at = loop.time() + interval
        request = KeepAliveRequest(session_id=session.session_id)

        async def call(stub: TimeSliceStub, timeout: float) -> KeepAliveResponse:
            return await stub.keep_alive(request, timeout=timeout)

        while self._session is session and not self._closed:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            # A fixed cadence; after a stall, resume from now rather than firing a burst.
            next_at = max(next_at + interval, loop.time())
            try:
                reply = await self._unary(
                    "KeepAlive", call, budget=min(self._call_timeout, interval)
                )
            except (SessionExpired, NotFound) as exc:
                self._session_lost(session, f"KeepAlive: {exc}")
                return
            except TimeSliceError as exc:
                if self._closed:
                    return
                log.warning("keepalive of session %s failed, retrying: %s", session.session_id, exc)
                continue
            self.keepalives_sent += 1
            self._note_yield_requests(set(reply.yield_requested))

    def _session_lost(self, session: _Session, reason: str) -> None:
        if self._session is not session:
            return
        self._session = None
        self.last_session_loss = reason
        lost = sorted(self._grants)
        self._grants.clear()
        log.warning(
            "session %s of job %s is gone (%s); holds released: %s; a new session opens on "
            "the next acquire",
            session.session_id,
            self._job_id,
            reason,
            ", ".join(lost) or "none",
        )
        keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None and keepalive is not asyncio.current_task():
            keepalive.cancel()

    # ------------------------------------------------------------------- acquire

    async def _acquire(
        self,
        group: str,
        timeout: float | None,
        priority: int,
        on_progress: ProgressCallback | None,
    ) -> Grant:
        self._check_open()
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
        outcome = _AcquireOutcome()
        loop = asyncio.get_running_loop()
        try:
            deadline = None if timeout is None else loop.time() + timeout
            limit = asyncio.timeout_at(deadline)
            try:
                async with limit:
                    await self._acquire_until_granted(group, priority, on_progress, outcome)
            except TimeoutError:
                if limit.expired():
                    raise Timeout(
                        f"job {self._job_id} was not granted group {group} within {timeout:g}s"
                    ) from None
                raise
            granted, session = outcome.granted, outcome.session
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
            session = outcome.session
            if outcome.granted is not None and session is not None and session is self._session:
                await self._give_back_raced(group, session, outcome.granted.epoch)
            raise
        finally:
            self._acquiring.discard(group)

    async def _acquire_until_granted(
        self,
        group: str,
        priority: int,
        on_progress: ProgressCallback | None,
        outcome: _AcquireOutcome,
    ) -> None:
        loop = asyncio.get_running_loop()
        backoff = Backoff()
        down_since: float | None = None
        renewed = False
        while True:
            self._check_open()
            session = await self._ensure_session()
            outcome.session = session
            target, stub = self._transport.stub()
            seen = outcome.events
            try:
                await self._acquire_stream(
                    stub, target, session, group, priority, on_progress, outcome
                )
                return
            except Exception as exc:
                if self._closed:
                    raise Cancelled(
                        f"the client of job {self._job_id} was closed while acquiring {group}"
                    ) from exc
                error = map_error(exc, f"Acquire({group}) via {target}")
                if error is None:
                    raise
                if isinstance(error, SessionExpired) and not renewed:
                    # The queue place went with the session; queue again under a new one.
                    self._session_lost(session, f"Acquire: {error}")
                    renewed = True
                    continue
                if not isinstance(error, Unavailable):
                    raise error from exc
                now = loop.time()
                if outcome.events > seen or down_since is None:
                    down_since = now
                    backoff.reset()
                elif now - down_since > session.ttl:
                    raise Unavailable(
                        f"no orchestrator replica reachable for {now - down_since:.1f}s while "
                        f"acquiring {group}; the session has expired: {error}"
                    ) from exc
                # Re-issuing Acquire with the same session re-attaches to our queue entry.
                self._transport.rotate()
                log.warning(
                    "acquire of %s: %s; re-attaching via %s", group, error, self._transport.current
                )
                await asyncio.sleep(backoff.next_delay())

    async def _acquire_stream(
        self,
        stub: TimeSliceStub,
        target: Target,
        session: _Session,
        group: str,
        priority: int,
        on_progress: ProgressCallback | None,
        outcome: _AcquireOutcome,
    ) -> None:
        request = AcquireRequest(
            session_id=session.session_id,
            job_id=self._job_id,
            group_id=group,
            priority=priority,
            request_id=outcome.request_id,
        )
        try:
            # No gRPC deadline: the wait is bounded by the caller's timeout (or not at all),
            # and aborting is done by cancelling, which resets the stream.
            async with stub.channel.request(
                _ACQUIRE_METHOD, Cardinality.UNARY_STREAM, AcquireRequest, AcquireEvent
            ) as stream:
                await stream.send_message(request, end=True)
                try:
                    while True:
                        event = await stream.recv_message()
                        if event is None:
                            # An error after some events arrives in the trailers: this raises
                            # it (GroupFaulted, SessionExpired, ...) as the status it carries.
                            await stream.recv_trailing_metadata()
                            raise InternalError(
                                f"the Acquire stream of group {group} ended without a grant"
                            )
                        if self._on_event(event, outcome, on_progress):
                            return
                except asyncio.CancelledError:
                    await self._drain_for_grant(stream, outcome)
                    raise
        except Exception as exc:
            if outcome.granted is None:
                raise
            # The grant arrived; only the tail of the stream failed. The grant stands.
            log.warning(
                "Acquire stream of %s via %s failed after the grant: %s",
                group,
                target,
                map_error(exc, target) or exc,
            )

    def _on_event(
        self,
        event: AcquireEvent,
        outcome: _AcquireOutcome,
        on_progress: ProgressCallback | None,
    ) -> bool:
        outcome.events += 1
        stage = AcquireStage.from_wire(event.state)
        if stage is AcquireStage.GRANTED:
            outcome.granted = event
            return True
        if stage is None:
            log.warning("ignoring Acquire event with unknown state %r", event.state)
            return False
        if on_progress is not None:
            on_progress(AcquireProgress(stage, int(event.queue_position)))
        return False

    async def _drain_for_grant(
        self, stream: Stream[AcquireRequest, AcquireEvent], outcome: _AcquireOutcome
    ) -> None:
        """Read events already received when an acquire is aborted.

        A GRANTED event may sit in the receive buffer when the abort lands; the server has
        then finished the stream and cannot see our cancel, so we must notice the grant
        ourselves and give it back.
        """
        while outcome.granted is None:
            try:
                event = await asyncio.wait_for(stream.recv_message(), _DRAIN_SECONDS)
            except (Exception, asyncio.CancelledError):
                return
            if event is None:
                return
            outcome.events += 1
            if AcquireStage.from_wire(event.state) is AcquireStage.GRANTED:
                outcome.granted = event

    async def _give_back_raced(self, group: str, session: _Session, epoch: int) -> None:
        """Yield a grant that arrived while its acquire was being aborted."""
        log.info("acquire of %s aborted after the grant (epoch %d); yielding it", group, epoch)
        try:
            await self._finish_even_if_cancelled(
                self._send_yield(session, group, epoch), f"timeslice-yield-{group}"
            )
        except Exception as exc:
            # The acquire's own error is what propagates; this one must still be seen.
            log.error(
                "could not give back group %s (epoch %d) after an aborted acquire: %s",
                group,
                epoch,
                exc,
            )

    # --------------------------------------------------------------------- yield

    async def _send_yield(self, session: _Session, group: str, epoch: int) -> int:
        """Send Yield; returns how many attempts it took."""
        attempts = 0
        request = YieldRequest(
            session_id=session.session_id, job_id=self._job_id, group_id=group, epoch=epoch
        )

        async def call(stub: TimeSliceStub, timeout: float) -> Any:
            nonlocal attempts
            attempts += 1
            return await stub.yield_(request, timeout=timeout)

        try:
            await self._unary(f"Yield({group})", call)
        except NotHolder:
            # A retried Yield whose first attempt landed finds the group already given back.
            if attempts > 1:
                return attempts
            raise
        return attempts

    async def _yield(self, group: str) -> None:
        self._check_open()
        grant = self._grants.get(group)
        session = self._session
        if grant is None or session is None:
            raise NotHolder(
                f"job {self._job_id} does not hold group {group} (no grant recorded by this client)"
            )
        # A yield cut short by a cancel would leave the group held until the session ends:
        # once started, it runs to completion, bookkeeping included.
        await self._finish_even_if_cancelled(
            self._yield_and_forget(session, group, grant), f"timeslice-yield-{group}"
        )

    async def _yield_and_forget(self, session: _Session, group: str, grant: Grant) -> None:
        try:
            await self._send_yield(session, group, grant.epoch)
        except (NotHolder, PermissionDenied):
            # The orchestrator's word: we do not hold it, so our record is stale.
            self._forget(group, grant)
            raise
        except SessionExpired as exc:
            self._session_lost(session, f"Yield: {exc}")
            raise
        self._forget(group, grant)

    def _forget(self, group: str, grant: Grant) -> None:
        if self._grants.get(group) is grant:
            del self._grants[group]

    # --------------------------------------------------------------------- close

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None:
            keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keepalive
        session, self._session = self._session, None
        self._grants.clear()
        if session is not None:
            request = CloseSessionRequest(session_id=session.session_id)

            async def call(stub: TimeSliceStub, timeout: float) -> Any:
                return await stub.close_session(request, timeout=timeout)

            try:
                await self._transport.unary(
                    "CloseSession", call, budget=min(self._call_timeout, _CLOSE_BUDGET)
                )
            except (TimeSliceError, StreamTerminatedError) as exc:
                log.warning(
                    "CloseSession of %s failed (its lease will expire): %s", session.session_id, exc
                )
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=1.0)
        self._transport.close()
