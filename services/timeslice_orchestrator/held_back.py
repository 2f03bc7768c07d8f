"""Waiters held back for a node that cannot restore them, and their deadline.

A job whose state is parked on a node that cannot restore it (its agent away, or back without
the job's workers yet: :func:`~timeslice_orchestrator.switch_plan.stranded`) is never granted:
its processes there would stay parked while it is told it holds the group. The driver serves
the next waiter in line instead, says why in the group's ``last_error``, and faults the waiter
once it has been held back for :attr:`DriverConfig.held_back_for` seconds
(``docs/fencing.md``, "A job parked on a node that is away").
"""

from __future__ import annotations

import logging
import time

from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.reconcile import DriverConfig, Next, OwnWrites
from timeslice_orchestrator.retries import Retry, RetryLedger
from timeslice_orchestrator.store.groups import Authority, Fault, GroupStore
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import AgentRecord, QueuedJob
from timeslice_orchestrator.switch_plan import stranded

# The driver's logger, as every part of the driver: a group's switches read in one stream.
log = logging.getLogger("timeslice_orchestrator.driver")


def held_back_note(job: str, nodes: list[str], wait: float) -> str:
    """What ``last_error`` says of a waiter held back for nodes that cannot restore it."""
    where = ", ".join(nodes)
    return (
        f"{job} waits: it is parked on {where}, whose agent is away or lists no worker of "
        f"{job} yet; granted once {where} has restored it, faulted after {wait:g} s"
    )


class HeldBack:
    """The waiters of this driver's groups held back now: ``due`` is each one's deadline."""

    def __init__(
        self,
        store: GroupStore,
        auth: Authority,
        metrics: Metrics,
        config: DriverConfig,
        writes: OwnWrites,
    ) -> None:
        self._store = store
        self._auth = auth
        self._metrics = metrics
        self._config = config
        self._writes = writes
        self.ledger = RetryLedger()
        """Held-back waiters by their queue entry; ``due``: when they are faulted."""

    async def first_servable(
        self, view: GroupView, ordered: list[QueuedJob], agents: dict[str, AgentRecord]
    ) -> QueuedJob | Next:
        """The first waiter in ``ordered`` that may be served, holding back those parked on a
        node that cannot restore them (:func:`stranded`); or what to do when none may.

        A held-back waiter's reason goes into ``last_error`` (written when it changes). One
        held back past its deadline (:attr:`DriverConfig.held_back_for`, from the first pass
        that held it back) is faulted: its acquire fails with the reason. The node's return
        changes the agents, which brings the group back here at once.
        """
        group = view.group
        if view.resident is None or not view.resident.record.parked:
            return ordered[0]  # nothing is parked anywhere (the common case)
        residency = view.resident.record
        now = time.monotonic()
        wait = self._config.held_back_for
        first: QueuedJob | None = None
        notes: list[str] = []
        for waiter in ordered:
            key = (group, waiter.job, waiter.revision)
            nodes = stranded(residency, group, waiter.job, agents, view.static_members)
            if not nodes:
                self.ledger.pop(key)
                first = first or waiter
                continue
            since = self.ledger.get(key)
            if since is None:
                since = Retry(0, now + wait)
                self.ledger.put(key, since)
                log.warning(
                    "group %s: %s held back: parked on %s, which cannot restore it now",
                    group,
                    waiter.job,
                    ", ".join(nodes),
                )
            if since.due <= now:
                return await self._give_up(view, waiter, nodes, wait)
            notes.append(held_back_note(waiter.job, nodes, wait))
        if notes:
            note = "; ".join(notes)
            if view.stats.last_error != note and await self._store.note_error(group, note):
                log.info("group %s: %s", group, note)
            view.stats.last_error = note  # kept by a grant this pass writes
        return first if first is not None else Next.LATER

    async def _give_up(
        self, view: GroupView, waiter: QueuedJob, nodes: list[str], wait: float
    ) -> Next:
        """Fault a waiter held back past its deadline for a node that cannot restore it."""
        where = ", ".join(nodes)
        reason = (
            f"{waiter.job} is parked on {where} (its processes there stopped or its state off "
            f"the devices) and {where} could not restore it for {wait:g} s: the node's agent "
            f"is away, or lists no worker of {waiter.job}; {waiter.job} is not granted "
            f"without it (acquire again once {where} is back)"
        )
        stats = view.stats
        stats.last_error = reason
        stats.faults += 1
        self.ledger.pop((view.group, waiter.job, waiter.revision))
        faulted = await self._store.fault_waiter(
            view.group, self._auth, Fault(waiter, reason), stats
        )
        if self._writes.wrote(view.group, faulted) is not None:
            log.error("group %s: %s isolated: %s", view.group, waiter.job, reason)
            self._metrics.switches.labels(outcome="held_back_too_long").inc()
        return Next.AGAIN
