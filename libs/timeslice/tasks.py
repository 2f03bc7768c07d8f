"""Supervised background tasks: the one supervisor of the SDK, the agent and the orchestrator.

Every background task goes through a :class:`Supervisor`: it keeps a reference (so a task is
never garbage-collected mid-flight), logs any unexpected failure with its traceback, reports it
to an optional hook (metrics), and, for tasks the process cannot live without, reports their
end so the process exits non-zero and its own supervisor (systemd, Kubernetes, Slurm)
restarts it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

log = logging.getLogger("timeslice.tasks")

T = TypeVar("T")

FailureHook = Callable[[str, BaseException], None]
"""Called with a failed task's kind and its exception (for example, to count it)."""


class Supervisor:
    """Owns background tasks; see the module docstring.

    ``owner`` names the process or client in log messages (``job <id>``, ``agent``).
    """

    def __init__(self, owner: str, *, on_failure: FailureHook | None = None) -> None:
        self._owner = owner
        self._on_failure = on_failure
        self._tasks: dict[asyncio.Task[Any], tuple[str, bool]] = {}
        self._fatal: asyncio.Future[BaseException] | None = None
        # Tasks cancelled through this supervisor: their end is no failure, critical or not.
        self._cancelled: set[asyncio.Task[Any]] = set()

    def spawn(
        self,
        coro: Coroutine[Any, Any, T],
        name: str,
        *,
        kind: str = "task",
        critical: bool = False,
    ) -> asyncio.Task[T]:
        """Start ``coro`` as a supervised task on the running loop.

        ``kind`` is a low-cardinality label (metrics, :meth:`running`); ``critical`` tasks
        must run for the life of the process, so their ending at all (even without an error)
        is fatal (:meth:`wait_fatal`).
        """
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks[task] = (kind, critical)
        if critical:
            self._fatal_future()
        task.add_done_callback(self._on_done)
        return task

    async def finish_even_if_cancelled(self, coro: Coroutine[Any, Any, T], name: str) -> T:
        """Await ``coro`` in its own task that a cancel of the caller does not stop.

        If the caller is cancelled, the task carries on, supervised: its failure, which nobody
        awaits any more, is logged.
        """
        task = asyncio.get_running_loop().create_task(coro, name=name)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if not task.done():
                self._tasks[task] = ("task", False)
                task.add_done_callback(self._on_done)
            raise

    def _fatal_future(self) -> asyncio.Future[BaseException]:
        if self._fatal is None:
            self._fatal = asyncio.get_running_loop().create_future()
        return self._fatal

    def _on_done(self, task: asyncio.Task[Any]) -> None:
        kind, critical = self._tasks.pop(task, ("task", False))
        on_purpose = task in self._cancelled
        self._cancelled.discard(task)
        exc: BaseException | None
        if task.cancelled():
            if not critical or on_purpose:
                return
            # Nobody asked it to stop: a CancelledError raised from below (a gRPC call whose
            # channel was closed under it). Silent, it would leave the process up without it.
            exc = RuntimeError(f"task {task.get_name()} was cancelled from below")
        else:
            exc = task.exception()
        if exc is not None:
            log.error(
                "task %s (%s) of %s failed: %r", task.get_name(), kind, self._owner, exc,
                exc_info=exc,
            )  # fmt: skip
            if self._on_failure is not None:
                self._on_failure(kind, exc)
        if critical:
            fatal = self._fatal_future()
            if not fatal.done():
                fatal.set_result(exc or RuntimeError(f"task {task.get_name()} ended"))

    async def wait_fatal(self) -> BaseException:
        """Return the failure of the first critical task that ends."""
        # Shielded: a waiter that gives up must not cancel the one future every waiter shares.
        return await asyncio.shield(self._fatal_future())

    def running(self, kind: str | None = None) -> list[asyncio.Task[Any]]:
        """Tasks still running, optionally only those of one kind."""
        return [t for t, (k, _) in self._tasks.items() if kind is None or k == kind]

    def cancel(self, task: asyncio.Task[Any]) -> None:
        """Stop one supervised task on purpose: its end, even a critical one's, is expected."""
        if task in self._tasks:
            self._cancelled.add(task)
        task.cancel()

    async def cancel_all(self, timeout: float) -> None:
        """Cancel every task and wait (bounded) for them to finish."""
        tasks = list(self._tasks)
        for task in tasks:
            self.cancel(task)
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
