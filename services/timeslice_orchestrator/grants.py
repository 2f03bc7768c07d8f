"""What a grant writes: the new hold of a waiter, and the residency a grant in place leaves.

A grant in place hands a group to a job whose state is already where it runs, so nothing
moves. Three paths make one: the driver (a lone waiter after a switch-free pass), an Acquire
of a free group nobody waits for (:func:`resident_after_grant`), and a Yield that finds the
next waiter's state resident (the releasing replica grants it at once, see
:meth:`timeslice_orchestrator.locks.LockService.release`). All three decide with the same
function, so they agree on when nothing needs to move.

When the Yield's replica also drives the group, its driver sees the yield's write too and
would race the hand-over with a grant of its own (one of the two transactions then fails its
compares: a wasted round trip and pass). :class:`HandOvers` says which groups are being
handed over here, so the driver leaves them alone and looks again once the hand-over ends.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from timeslice.errors import NotFound
from timeslice_orchestrator.store.follower import MIRROR_LAG_TIMEOUT, Mirror
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import (
    AgentRecord,
    HolderRecord,
    QueuedJob,
    ResidentRecord,
)
from timeslice_orchestrator.switch_plan import stranded


def group_known(view: GroupView, creator: str | None, agents: dict[str, AgentRecord]) -> bool:
    """Whether ``view``'s group is known (docs/groups.md): a node serves it, or an operator
    created it.

    A node serves it when a connected (or reconnecting) agent has a worker registered in it,
    or when nodes are pinned to it; an operator created it when its meta key names no job
    (``creator`` is "": SetGroupMembers, or a replica too old to record the job). A group
    that a job's Acquire created and that nobody serves is not known: acquiring it again
    still computes on devices nobody plans for it.
    """
    if view.static_members or creator == "":
        return True
    group = view.group
    return any(worker.group == group for agent in agents.values() for worker in agent.workers)


def unknown_group_text(group: str) -> str:
    """What is wrong with an unknown group, and how to fix it: the grant's warning and the
    strict refusal share it."""
    return (
        f"group {group} is not known: no node serves it (no agent has a worker registered "
        "in it, no nodes are pinned to it) and no operator created it. Check the name "
        "(`timeslice groups` lists the groups); register the job's workers with their node "
        "agent before acquiring (timeslice.worker.register), or have an operator create it "
        f"(`timeslice members {group} --set NODES`)"
    )


class KnownGroups:
    """Whether a group is known, as the mirror shows it (docs/groups.md): the grant's
    warning and strict mode's refusal, asked at every grant (the cheap answer first: a group
    an operator created needs no view and no agent record)."""

    def __init__(self, mirror: Mirror) -> None:
        self._mirror = mirror

    def known(self, group: str) -> bool:
        creator = self._mirror.group_creator(group)
        if creator == "":
            return True
        return group_known(self._mirror.group(group), creator, self._mirror.agents())

    def warning(self, group: str) -> str:
        """The grant's warning, "" for a known group. Judged at the grant, once the mirror
        holds the Acquire's own write, so also every worker registration confirmed before it
        was sent (their writes precede it in etcd)."""
        return "" if self.known(group) else unknown_group_text(group)

    async def require(self, group: str) -> None:
        """Raise NotFound unless ``group`` is known; writes nothing of the group."""
        if self.known(group):
            return
        # The mirror may not show yet a registration or pin just made through another
        # replica: look again once it holds everything etcd held (a write of the replica's
        # beacon key, no group key), before refusing.
        await self._mirror.catch_up(MIRROR_LAG_TIMEOUT)
        if not self.known(group):
            raise NotFound(f"{unknown_group_text(group)}. Refused: strict groups are on")


def holder_for(
    waiter: QueuedJob, *, restored: bool = False, previous: str = "", switch_seconds: float = 0.0
) -> HolderRecord:
    """The hold ``waiter`` gets; its ticket is its place in line (the entry's revision)."""
    now = time.time()
    entry = waiter.entry.record
    return HolderRecord(
        job=waiter.job,
        session=entry.session,
        request_id=entry.request_id,
        attempt=entry.attempt,
        ticket=waiter.revision,
        granted_at=now,
        waited_seconds=max(0.0, now - entry.enqueued_at),
        restored=restored,
        previous_job=previous,
        switch_seconds=switch_seconds,
    )


def in_place(view: GroupView, job: str, agents: dict[str, AgentRecord]) -> ResidentRecord | None:
    """The residency after granting ``job`` without moving anything, or None if it cannot be.

    ``view`` is the group as the grant finds it (no holder). Nothing moves when no switch
    runs, every pinned node's agent is present, and the job's state is already on every node
    where it runs (its workers' nodes and the pinned ones): exactly when the switch plan has
    no steps. Never while the job is parked on a node that cannot restore it (its agent away:
    :func:`~timeslice_orchestrator.switch_plan.stranded`): the driver holds it back. The job
    becomes the most recently used on its nodes (evicted last).
    """
    if view.holder is not None or view.switch is not None:
        return None
    if any(node not in agents for node in view.static_members):
        return None
    residency = view.residency()
    if stranded(residency, view.group, job, agents, view.static_members):
        return None
    runs_on = {n for n, a in agents.items() if job in a.jobs_of(view.group)}
    if any(job not in residency.nodes.get(n, []) for n in runs_on | set(view.static_members)):
        return None
    for node, jobs in list(residency.nodes.items()):
        if job in jobs:
            residency.place(node, job)
    return residency


def resident_after_grant(
    view: GroupView, job: str, agents: dict[str, AgentRecord]
) -> ResidentRecord | None:
    """The residency after granting ``job`` a free group nobody waits for, or None.

    What the driver would do for a lone waiter whose state needs no moving, so an Acquire
    can take the group in its own transaction.
    """
    if view.queue:
        return None
    return in_place(view, job, agents)


def changed(view: GroupView, residency: ResidentRecord) -> ResidentRecord | None:
    """``residency`` if a grant changes the group's residency record as read, else None.

    A grant compares the residency it was computed from either way; an unchanged record is
    not written again (one key fewer in the transaction, one event fewer for every watcher):
    the common case of a job taking back a group whose state it already holds. A group
    without a record gets one.
    """
    if view.resident is not None and view.resident.record == residency:
        return None
    return residency


class HandOvers:
    """The groups this replica is handing to a waiter on a yield, right now."""

    def __init__(self) -> None:
        self._groups: set[str] = set()
        self._listeners: list[Callable[[str], None]] = []

    def __contains__(self, group: object) -> bool:
        return group in self._groups

    @contextlib.contextmanager
    def handing(self, group: str) -> Iterator[None]:
        """Mark ``group`` while the block runs; then tell the listeners to look at it."""
        self._groups.add(group)
        try:
            yield
        finally:
            self._groups.discard(group)
            for listener in list(self._listeners):
                listener(group)

    def add_listener(self, listener: Callable[[str], None]) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[str], None]) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)
