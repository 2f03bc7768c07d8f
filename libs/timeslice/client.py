"""The synchronous client of the timeslice orchestrator.

It owns a private asyncio event loop in a daemon thread and runs an
:class:`~timeslice.aio.AsyncTimeSliceClient` there, so session keepalives keep flowing while
the caller's thread computes (a training step may well hold the GIL-free accelerators for
minutes). Every call is submitted to that loop and waited for with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import Any, TypeVar

from timeslice._acquire import ProgressCallback
from timeslice._loops import call_in_loop
from timeslice._scope import AcceleratorScope
from timeslice._types import Grant
from timeslice._validate import check_priority, check_seconds
from timeslice.aio import AsyncTimeSliceClient, rebuild_client
from timeslice.errors import Cancelled, InternalError, InvalidArgument, TimeSliceError
from timeslice.ids import validate_group_id
from timeslice.placement import JobProfile
from timeslice_proto.timeslice.v1 import GroupStatus, GroupSummary

log = logging.getLogger("timeslice")

T = TypeVar("T")

# Slack on top of a call's own bound before a blocked caller gives up on the loop thread.
_SLACK = 1.0
_JOIN_SECONDS = 5.0


def _run_loop(loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(started.set)
    try:
        loop.run_forever()
    finally:
        try:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def _shutdown(
    client: AsyncTimeSliceClient,
    loop: asyncio.AbstractEventLoop,
    thread: threading.Thread,
    budget: float,
) -> None:
    """Close the async client on its loop, then stop the loop and its thread.

    Runs at most once per client (``weakref.finalize``): from ``close()``, when the client is
    garbage-collected, or at interpreter exit.
    """
    if loop.is_closed() or not thread.is_alive():
        return
    if threading.current_thread() is thread:
        # Collected on the loop thread itself: it cannot wait for itself, so chain the stop.
        async def close_then_stop() -> None:
            try:
                await client.close()
            finally:
                loop.stop()

        loop.create_task(close_then_stop())
        return
    try:
        call_in_loop(loop, client.close(), wait=budget, grace=0.0, what="close")
    except Exception as exc:
        log.warning("closing the timeslice client of job %s failed: %s", client.job_id, exc)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_JOIN_SECONDS)
        if thread.is_alive():
            log.warning(
                "the event loop thread of job %s did not stop within %.0fs",
                client.job_id,
                _JOIN_SECONDS,
            )


class TimeSliceOrchestratorClient:
    """Synchronous client of the timeslice orchestrator (same API as the asyncio one).

    Example (``TIMESLICE_JOB_ID`` set in the environment)::

        from timeslice import TimeSliceOrchestratorClient
        orchestrator = TimeSliceOrchestratorClient(target="localhost:50051")

        @orchestrator.on_accelerators(group_id="trainer-group")
        def train_phase(model, trajectories):
            return model.update(trajectories)

    Args:
        target: one ``host:port``, a comma-separated list, or a sequence of them. Default:
            ``TIMESLICE_TARGET``, else ``localhost:50051``.
        job_id: the job this client acts for. Default: ``TIMESLICE_JOB_ID``.
        session_ttl: lease TTL of the session in seconds (keepalives every ttl/3).
        call_timeout: the bound on every unary call, retries and failover included.
        strict_groups: refuse (NotFound) an acquire of a group that is not known, instead
            of a grant with a warning (see :class:`~timeslice.AsyncTimeSliceClient`).

    ``on_accelerators`` also wraps ``async`` functions: they acquire through this client's
    loop while awaiting on the caller's. Closing is idempotent, and clients still open at
    interpreter exit are closed then (their session ends at once rather than by TTL).
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
        # Validate everything before starting a thread, so bad input leaves nothing behind.
        self._client = AsyncTimeSliceClient(
            target,
            job_id=job_id,
            session_ttl=session_ttl,
            call_timeout=call_timeout,
            on_yield_request=on_yield_request,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            insecure=insecure,
            strict_groups=strict_groups,
        )
        self._call_timeout = float(call_timeout)
        self._runner = self._client.runner
        self._loop = asyncio.new_event_loop()
        self._runner.bind(self._loop)
        started = threading.Event()
        self._thread = threading.Thread(
            target=_run_loop,
            args=(self._loop, started),
            name=f"timeslice-client-{self._client.job_id}",
            daemon=True,
        )
        self._thread.start()
        # Blocking calls check that the loop runs: the first one may come right away.
        if not started.wait(_JOIN_SECONDS):
            raise InternalError("the timeslice client's event loop thread did not start")
        self._finalizer = weakref.finalize(
            self, _shutdown, self._client, self._loop, self._thread, self._call_timeout + _SLACK
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its settings, like :class:`AsyncTimeSliceClient`: a copy in another
        process (a Ray task or actor) starts its own loop thread and session on first use."""
        return (rebuild_client, (type(self), self._client.settings()))

    # ----------------------------------------------------------------- properties

    @property
    def job_id(self) -> str:
        """The job this client acts for."""
        return self._client.job_id

    @property
    def targets(self) -> list[str]:
        """The orchestrator addresses, in failover order."""
        return self._client.targets

    @property
    def session_id(self) -> str | None:
        """The open session's id, or ``None`` before the first acquire / after a loss."""
        return self._client.session_id

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran (or the interpreter is exiting)."""
        return not self._finalizer.alive

    @property
    def aio(self) -> AsyncTimeSliceClient:
        """The asyncio client this one drives (bound to the private loop thread)."""
        return self._client

    def grants(self) -> dict[str, Grant]:
        """The groups this client holds by its own record, keyed by group id."""
        return self._client.grants()

    def yield_requested(self, group_id: str) -> bool:
        """The co-operative "please yield" signal (see AsyncTimeSliceClient.yield_requested)."""
        return self._client.yield_requested(group_id)

    def __repr__(self) -> str:
        return (
            f"TimeSliceOrchestratorClient(targets={self.targets!r}, job_id={self.job_id!r}, "
            f"session_id={self.session_id!r}, closed={self.closed})"
        )

    # ----------------------------------------------------------------- public API

    def acquire(
        self,
        group_id: str,
        *,
        timeout: float | None = None,
        priority: int = 0,
        on_progress: ProgressCallback | None = None,
    ) -> Grant:
        """Block until this job holds ``group_id``; see :meth:`AsyncTimeSliceClient.acquire`.

        ``on_progress`` runs on the client's loop thread. Interrupting the wait (for example
        with Ctrl-C) cancels the acquire cleanly before the interrupt propagates.
        """
        # Bad arguments are reported before a closed client is (the runner checks them too).
        validate_group_id(group_id)
        check_seconds(timeout, "timeout", allow_none=True)
        check_priority(priority)
        if on_progress is not None and not callable(on_progress):
            raise InvalidArgument("on_progress must be callable")
        self._check_open()
        return self._runner.acquire_blocking(
            group_id, timeout=timeout, priority=priority, on_progress=on_progress
        )

    def yield_(self, group_id: str) -> None:
        """Give ``group_id`` back; see :meth:`AsyncTimeSliceClient.yield_`."""
        validate_group_id(group_id)
        self._check_open()
        self._runner.yield_blocking(group_id)

    release = yield_

    def acquire_all(
        self, group_ids: Sequence[str], *, timeout: float | None = None, priority: int = 0
    ) -> dict[str, Grant]:
        """Hold every group at once, deadlock-free; see :meth:`AsyncTimeSliceClient.acquire_all`."""
        self._check_open()
        wait = check_seconds(timeout, "timeout", allow_none=True)
        # After the wait: giving back a grant that raced the deadline, then the rollback, up to
        # a yield per group held, each bounded by call_timeout. A shorter bound would return
        # while the rollback goes on, the groups still held.
        cleanup = (len(group_ids) + 1) * self._call_timeout
        return call_in_loop(
            self._loop,
            self._client.acquire_all(group_ids, timeout=wait, priority=priority),
            wait=None if wait is None else wait + cleanup + _SLACK,
            grace=cleanup,
            what=f"acquire_all({', '.join(group_ids)})",
            # Held just as this caller gave up (Ctrl-C, its deadline): given back.
            undo=self._give_back_all,
        )

    async def _give_back_all(self, held: dict[str, Grant]) -> None:
        try:
            await self._client.yield_all(list(held))
        except TimeSliceError as exc:  # the caller's own error is what propagates
            log.warning("could not give back %s after its caller left: %s", sorted(held), exc)

    def yield_all(self, group_ids: Sequence[str]) -> None:
        """Yield every group in ``group_ids``."""
        self._check_open()
        call_in_loop(
            self._loop,
            self._client.yield_all(group_ids),
            wait=len(group_ids) * self._call_timeout + _SLACK,
            grace=self._call_timeout,
            what="yield_all",
        )

    def status(self, group_id: str) -> GroupStatus:
        """The group's holder, queue, residency, switch in flight and faults."""
        validate_group_id(group_id)
        self._check_open()
        return self._call(self._client.status(group_id), f"status({group_id})")

    def groups(self) -> list[GroupSummary]:
        """One summary per known group."""
        self._check_open()
        return self._call(self._client.groups(), "groups()")

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
        """Hold ``group_id`` around a function or block (decorator, ``with``, ``async with``),
        or the group the orchestrator placed this job's ``role`` in ``pool`` on (see
        :meth:`AsyncTimeSliceClient.on_accelerators`, docs/placement.md).

        See :class:`~timeslice.AcceleratorScope`.
        """
        wait = check_seconds(timeout, "timeout", allow_none=True)
        if pool is not None or role is not None:
            scope = self._client.on_accelerators(
                group_id, pool=pool, role=role, profile=profile, timeout=wait, priority=priority
            )
            # Rebuilt from this client when pickled (see below).
            scope._owner = self
            return scope
        if group_id is None:
            raise InvalidArgument("on_accelerators needs a group_id, or a pool and a role")
        group = validate_group_id(group_id)
        # Owned by this client, so a pickled scope comes back as a scope of this client's
        # copy (with its own loop thread), not of the asyncio client inside it.
        return AcceleratorScope(self._runner, group, wait, check_priority(priority), owner=self)

    def group_for(self, pool: str, role: str = "main", *, profile: JobProfile | None = None) -> str:
        """The group of this job's ``role`` in placement ``pool``; see
        :meth:`AsyncTimeSliceClient.group_for`."""
        self._check_open()
        return self._call(self._client.group_for(pool, role, profile=profile), f"group_for({pool})")

    def close(self) -> None:
        """End the session (best effort), stop the loop thread. Idempotent."""
        self._finalizer()

    def __enter__(self) -> TimeSliceOrchestratorClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ internal

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise Cancelled(f"the timeslice client of job {self.job_id} was closed")

    def _call(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        return call_in_loop(
            self._loop, coro, wait=self._call_timeout + _SLACK, grace=_SLACK, what=what
        )
