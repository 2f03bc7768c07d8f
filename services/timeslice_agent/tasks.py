"""The agent's background tasks and keyed locks.

Tasks go through the one supervisor of the project (:mod:`timeslice.tasks`); the agent's
flavour also counts failures in ``timeslice_agent_task_failures_total{task}``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from timeslice import tasks
from timeslice.tasks import run_to_completion
from timeslice_agent.metrics import AgentMetrics

__all__ = ["KeyedLocks", "LockWaitExpired", "Supervisor", "run_to_completion"]


class Supervisor(tasks.Supervisor):
    """The shared supervisor (:class:`timeslice.tasks.Supervisor`), counting failures in
    ``timeslice_agent_task_failures_total{task}``."""

    def __init__(self, metrics: AgentMetrics) -> None:
        def count(kind: str, exc: BaseException) -> None:
            metrics.task_failures.labels(kind).inc()

        super().__init__("agent", on_failure=count)


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
