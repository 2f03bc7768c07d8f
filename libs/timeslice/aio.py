"""The asyncio client of the timeslice orchestrator.

A job wraps each accelerator phase of its loop in ``acquire`` / ``yield_`` (or
``on_accelerators``); the orchestrator grants the group's accelerators to one job at a time
and moves device state between jobs while they wait.

The client is put together from small parts:

- :mod:`timeslice.runner`: the event loop the client lives on, and blocking use of it;
- :mod:`timeslice._core`: on that loop, the session and one tenure per group, and the acquire
  and yield calls that move them;
- :mod:`timeslice._tenure`: a group's tenure, a state machine (acquiring, held, releasing,
  sweeping) whose transitions are the ordering rules of acquire and yield;
- :mod:`timeslice._session`: the session (lease, keepalive, loss, close);
- :mod:`timeslice._acquire`: one acquire call (stream, failover, re-attach, abort);
- :mod:`timeslice._release`: a yield the orchestrator did not confirm in time, retried until
  it does; :mod:`timeslice._sweep`: what an aborted acquire left, taken back;
- :mod:`timeslice._transport`: channels to every replica, unary calls with failover;
- :mod:`timeslice._streams`: the retrying stream both acquire and :meth:`watch` use;
- :mod:`timeslice._watch`: the open watches, on their consumers' loops.

This module is the public shell: it checks arguments and routes each call to the runner.

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
from collections.abc import AsyncGenerator, Callable, Sequence
from types import TracebackType
from typing import Any, TypeVar

from timeslice._acquire import ProgressCallback
from timeslice._core import ClientCore
from timeslice._roles import Roles, role_key
from timeslice._scope import AcceleratorScope
from timeslice._tenure import TenureState
from timeslice._transport import Transport
from timeslice._types import Grant
from timeslice._validate import check_positive, check_priority, check_seconds
from timeslice._watch import Watches
from timeslice._yields import YieldStreams
from timeslice.errors import InvalidArgument, TimeSliceError
from timeslice.ids import validate_group_id, validate_job_id
from timeslice.placement import JobProfile
from timeslice.runner import ClientRunner
from timeslice.targets import Target, targets_from_env
from timeslice.tasks import Supervisor, run_to_completion
from timeslice.tls import client_tls
from timeslice.worker import check_can_enter
from timeslice_proto.timeslice.placement.v1 import PlaceResponse
from timeslice_proto.timeslice.v1 import (
    GroupEvent,
    GroupStatus,
    GroupSummary,
    TimeSliceStub,
)

__all__ = ["AsyncTimeSliceClient", "ProgressCallback"]

log = logging.getLogger("timeslice")

T = TypeVar("T")


def rebuild_client(cls: Callable[..., T], settings: dict[str, Any]) -> T:
    """Unpickle a client: a new one from the settings of the pickled one."""
    return cls(**settings)


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
        strict_groups: ``True`` makes :meth:`acquire` refuse a group that is not known (no
            node serves it, no operator created it: a mistyped name) with
            :class:`~timeslice.errors.NotFound`, instead of getting it created and granted
            with a warning (:attr:`Grant.warning`, also logged). See docs/groups.md.

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
        strict_groups: bool = False,
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
        self._on_yield_request = on_yield_request
        self._strict_groups = bool(strict_groups)
        self._transport = Transport(self._targets, self._tls)
        # Yields go over one long-lived stream per connection (_yields.py).
        self._yield_streams = YieldStreams()
        self._tasks = Supervisor(f"job {self._job_id}")
        # The session and the tenure of each group, on the client's loop (_core.py).
        self._core = ClientCore(
            self._transport,
            job_id=self._job_id,
            session_ttl=self._session_ttl,
            call_timeout=self._call_timeout,
            on_yield_request=on_yield_request,
            tasks=self._tasks,
            yield_streams=self._yield_streams,
            strict_groups=self._strict_groups,
        )
        self._runner = ClientRunner(self._job_id, call_timeout=self._call_timeout, calls=self._core)
        self._watches = Watches(
            self._targets,
            self._tls,
            job_id=self._job_id,
            call_timeout=self._call_timeout,
            closed=lambda: self._core.closed,
        )
        # Where this job's roles in placement pools run (docs/placement.md).
        self._roles = Roles(self._job_id, self._runner, self._core, self._call_timeout)

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
            "strict_groups": self._strict_groups,
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
        session = self._core.session
        return session.session_id if session is not None else None

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran; every later call raises ``Cancelled``."""
        return self._core.closed

    @property
    def keepalives_sent(self) -> int:
        """KeepAlive calls answered so far (all sessions)."""
        return self._core.keepalives_sent

    @property
    def last_session_loss(self) -> str | None:
        """Why the last session was lost, if one was."""
        return self._core.last_session_loss

    @property
    def runner(self) -> ClientRunner:
        """Drives this client on its event loop from other loops and from blocking code.

        Used by :class:`~timeslice.TimeSliceOrchestratorClient` and
        :class:`~timeslice.AcceleratorScope`; see :mod:`timeslice.runner`.
        """
        return self._runner

    def grants(self) -> dict[str, Grant]:
        """The groups this client holds by its own record, keyed by group id."""
        return self._core.tenures.grants()

    def yield_requested(self, group_id: str) -> bool:
        """True when the orchestrator asked this job to yield ``group_id`` soon.

        The co-operative "please yield" signal: the job has held the group longer than the
        orchestrator's ``--max-hold`` while others wait. Nothing is taken away by force; a
        long accelerator phase can check this between steps and yield at a good point. It
        is refreshed with every session keepalive (every ttl/3).
        """
        held = self._core.tenures.state_of(group_id) is TenureState.HELD
        return held and group_id in self._core.yield_requests

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(targets={self.targets!r}, job_id={self._job_id!r}, "
            f"session_id={self.session_id!r}, closed={self.closed})"
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
        self,
        group_id: str | None = None,
        *,
        pool: str | None = None,
        role: str | None = None,
        profile: JobProfile | None = None,
        timeout: float | None = None,
        priority: int = 0,
    ) -> AcceleratorScope:
        """Hold ``group_id`` around a function or block; see :class:`AcceleratorScope`.

        Works as a decorator on plain and ``async`` functions and as ``async with``. As a
        plain ``with`` (or on a plain function) it blocks, which needs this client's loop to
        run in another thread (use :class:`TimeSliceOrchestratorClient` in synchronous code).

        Instead of a group, a job may name a ``role`` (default ``main``) in a placement
        ``pool``: the orchestrator picks the group (:meth:`group_for`, docs/placement.md),
        placing the role by ``profile`` (its declared busy fraction, period, ...) until its
        holds are measured.
        """
        wait = check_seconds(timeout, "timeout", allow_none=True)
        if pool is not None or role is not None:
            key = role_key(group_id, pool, role)
            return self._roles.scope(self, key, profile, wait, check_priority(priority))
        if group_id is None:
            raise InvalidArgument("on_accelerators needs a group_id, or a pool and a role")
        group = validate_group_id(group_id)
        return AcceleratorScope(self._runner, group, wait, check_priority(priority), owner=self)

    async def group_for(
        self, pool: str, role: str = "main", *, profile: JobProfile | None = None
    ) -> str:
        """The group of this job's ``role`` in placement ``pool``, asked for once and kept
        for the client's life (:mod:`timeslice._roles`, docs/placement.md). ``profile``: the
        role's declared profile, used until its holds are measured.

        Raises:
            ResourceExhausted: no group of the pool can take the role (the reason says why).
            NotFound: no such pool.
        """
        key = role_key(None, pool, role)
        self._roles.declare(key, profile)
        return await self._runner.run(self._roles.resolve(key))

    async def place(
        self,
        pool: str,
        roles: Sequence[str],
        *,
        profiles: dict[tuple[str, str], JobProfile] | None = None,
    ) -> PlaceResponse:
        """``Placement.Place`` for this job: each role's group, nodes and reason. The groups
        are kept as :meth:`group_for` keeps them (the later answer wins). ``profiles``:
        declared profiles by (pool, role)."""
        return await self._runner.run(self._roles.place(pool, roles, profiles))

    async def status(self, group_id: str) -> GroupStatus:
        """The group's holder, queue, residency, switch in flight and faults."""
        group = validate_group_id(group_id)
        return await self._runner.run(self._core.group_status(group))

    async def groups(self) -> list[GroupSummary]:
        """One summary per known group."""

        async def call(stub: TimeSliceStub, timeout: float) -> list[GroupSummary]:
            return list((await stub.list_groups(timeout=timeout)).groups)

        return await self._runner.run(self._core.unary("ListGroups", call))

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
        self._core.check_open()
        async with contextlib.aclosing(self._watches.follow(group)) as events:
            async for event in events:
                yield event

    async def close(self) -> None:
        """End the session (CloseSession, best effort) and close the connections.

        Everything the session held is released by the orchestrator. A waiting acquire and
        every open :meth:`watch` raise :class:`Cancelled`. Idempotent.
        """
        if self.closed:
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

    async def _close(self) -> None:
        if self._core.closed:
            return
        # Before the watches end: a watch whose read breaks now knows why.
        self._core.closed = True
        self._watches.end_all()
        await self._core.close()
