"""The state file's writability: write, and on failure stop answering until a write succeeds.

When the state file cannot be written (a full or read-only disk) the node answers no directive
at all: the link tells the orchestrator (``StateUnwritable``), which fences the node out as if
it had gone silent, so its switches go on without it and no job is faulted for the disk
(``docs/fencing.md``). The write is retried in the background (at most every
:data:`UNWRITABLE_RETRY_MAX_SECONDS`); once one succeeds, the link says hello again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.statefile import AgentState, StateStore, StateWriteError
from timeslice_agent.tasks import Supervisor

log = logging.getLogger(__name__)

# While the state file cannot be written, the write is retried after these waits (doubling).
UNWRITABLE_RETRY_INITIAL_SECONDS = 0.2
UNWRITABLE_RETRY_MAX_SECONDS = 2.0


class Durability:
    """Writes the state file and tracks whether it can be written.

    ``on_unwritable`` and ``on_writable`` tell the link (set by the agent; no-ops by default).
    """

    def __init__(
        self,
        path: Path,
        snapshot: Callable[[], AgentState],
        metrics: AgentMetrics,
        supervisor: Supervisor,
    ) -> None:
        self.store = StateStore(path, snapshot)
        self._metrics = metrics
        self._supervisor = supervisor
        # Why the state file cannot be written ("" while it can); told to the link.
        self._unwritable = ""
        self.on_unwritable: Callable[[str], None] = lambda reason: None
        self.on_writable: Callable[[], None] = lambda: None
        self.closing = False  # a stopping agent's last write is not retried

    @property
    def unwritable(self) -> str | None:
        """Why the state file cannot be written, or None while it can."""
        return self._unwritable or None

    async def persist(self) -> bool:
        """Write the state file; a failure is logged and counted, never raised."""
        return await self.save() is None

    async def save(self) -> StateWriteError | None:
        """Write the state file; returns the failure (logged and counted), or None."""
        try:
            await self.store.save()
        except StateWriteError as exc:
            self._metrics.state_write_failures.inc()
            if not self._unwritable:
                log.error("%s", exc)
            self._failed(exc)
            return exc
        self._succeeded()
        return None

    def _failed(self, exc: StateWriteError) -> None:
        """Stop answering directives until a write succeeds; retry it in the background."""
        if self._unwritable:
            return
        self._unwritable = str(exc)
        log.error(
            "the state file %s cannot be written: this node answers no directive until it can "
            "(the orchestrator fences it out); retrying at most every %g s",
            self.store.path,
            UNWRITABLE_RETRY_MAX_SECONDS,
        )
        self.on_unwritable(self._unwritable)
        if not self.closing:
            self._supervisor.spawn(self._retry(), name="state-retry", kind="persist")

    def _succeeded(self) -> None:
        if not self._unwritable:
            return
        self._unwritable = ""
        log.warning("the state file %s can be written again: rejoining", self.store.path)
        self.on_writable()

    async def _retry(self) -> None:
        delay = UNWRITABLE_RETRY_INITIAL_SECONDS
        while self._unwritable:
            await asyncio.sleep(delay)
            delay = min(delay * 2, UNWRITABLE_RETRY_MAX_SECONDS)
            if not self._unwritable:
                return
            try:
                await self.store.save()
            except StateWriteError as exc:
                self._metrics.state_write_failures.inc()
                log.debug("the state file still cannot be written: %s", exc)
                continue
            self._succeeded()
