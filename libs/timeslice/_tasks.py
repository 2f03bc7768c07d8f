"""Background tasks of one client: supervised, so no failure goes unseen."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

log = logging.getLogger("timeslice")

T = TypeVar("T")


class Supervisor:
    """Starts a client's background tasks, logs their failures and cancels them on close.

    ``owner`` names the client in log messages (``job <id>``).
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        """Start a task on the running loop; its failure is logged, never dropped."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    async def finish_even_if_cancelled(self, coro: Coroutine[Any, Any, T], name: str) -> T:
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

    async def cancel_all(self, timeout: float) -> None:
        """Cancel every task still running and give them ``timeout`` seconds to finish."""
        pending = [t for t in self._tasks if not t.done()]
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=timeout)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background task %s of %s failed", task.get_name(), self._owner, exc_info=exc)
