"""Supervision of the agent's background tasks.

Every task the agent starts goes through :class:`Supervisor`: it keeps a reference (so a task
is never garbage-collected mid-flight), logs any unexpected failure with its traceback, counts
it in ``timeslice_agent_task_failures_total{task}``, and, for tasks the agent cannot live
without, reports the failure so the process exits non-zero and its own supervisor (systemd,
Kubernetes, Slurm) restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Coroutine
from typing import Any, TypeVar

from timeslice_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")


class Supervisor:
    """Owns background tasks; see the module docstring."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics
        self._tasks: dict[asyncio.Task[Any], tuple[str, bool]] = {}
        self._fatal: asyncio.Future[BaseException] | None = None

    def _fatal_future(self) -> asyncio.Future[BaseException]:
        if self._fatal is None:
            self._fatal = asyncio.get_running_loop().create_future()
        return self._fatal

    def spawn(
        self, coro: Coroutine[Any, Any, T], *, name: str, kind: str, critical: bool = False
    ) -> asyncio.Task[T]:
        """Start ``coro`` as a supervised task.

        ``kind`` is the low-cardinality label for metrics; ``critical`` tasks must run for the
        life of the agent, so their ending at all (even without an error) is fatal.
        """
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks[task] = (kind, critical)
        if critical:
            self._fatal_future()
        task.add_done_callback(self._on_done)
        return task

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        kind, critical = self._tasks.pop(task, ("unknown", False))
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("task %s (%s) failed: %r", task.get_name(), kind, exc, exc_info=exc)
            self._metrics.task_failures.labels(kind).inc()
        if critical:
            fatal = self._fatal_future()
            if not fatal.done():
                fatal.set_result(exc or RuntimeError(f"task {task.get_name()} ended"))

    async def wait_fatal(self) -> BaseException:
        """Return the failure of the first critical task that ends."""
        return await self._fatal_future()

    def running(self, kind: str | None = None) -> list[asyncio.Task[Any]]:
        """Tasks still running, optionally only those of one kind."""
        return [t for t, (k, _) in self._tasks.items() if kind is None or k == kind]

    async def cancel_all(self, timeout: float) -> None:
        """Cancel every task and wait (bounded) for them to finish."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                log.error(
                    "task %s did not stop within %g s of cancellation", task.get_name(), timeout
                )


async def run_to_completion(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the caller is cancelled meanwhile (once or more).

    For steps that must not stop halfway, such as putting processes back after a failed
    checkpoint: a cancellation that arrives meanwhile is held back and re-raised once the work
    has finished (so a deadline still ends the caller, as a TimeoutError, afterwards).
    """
    task = asyncio.ensure_future(work)
    interrupted = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if task.cancelled():
                raise
            interrupted = True
    if interrupted:
        if not task.cancelled():
            task.exception()  # observed: the caller is told of the cancellation instead
        raise asyncio.CancelledError
    return task.result()


class LockWaitExpired(Exception):
    """:meth:`KeyedLocks.holding` gave up waiting at its deadline."""


class KeyedLocks:
    """One FIFO lock per key, created on first use and dropped when nobody uses it."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[asyncio.Lock, list[int]]] = {}

    def busy(self, key: str) -> bool:
        """True while someone holds or waits for ``key``'s lock."""
        return key in self._entries

    @contextlib.asynccontextmanager
    async def holding(self, key: str, deadline: float | None) -> AsyncIterator[None]:
        """Hold ``key``'s lock; raises :class:`LockWaitExpired` if not had by ``deadline``."""
        lock, users = self._entries.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    await lock.acquire()
            except TimeoutError:
                raise LockWaitExpired(key) from None
            try:
                yield
            finally:
                lock.release()
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._entries[key]
