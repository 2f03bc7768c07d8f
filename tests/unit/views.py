"""Group views and agent records for pure tests, built from the real record classes.

Revisions follow etcd's rules where the code under test compares them: a queue entry's create
revision is its place in line, and a key written later has a larger revision.
"""

from __future__ import annotations

from typing import TypeVar

from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import (
    AgentRecord,
    FaultRecord,
    HolderRecord,
    JobUsageRecord,
    NodeStep,
    QueuedJob,
    QueueRecord,
    ResidentRecord,
    Stored,
    SwitchPhase,
    SwitchRecord,
    UsageRecord,
    WorkerRecord,
)

GROUP = "g"
GB = 1 << 30


T = TypeVar("T")


def stored(record: T, revision: int, lease: int = 0) -> Stored[T]:
    """``record`` as etcd holds it, created (and last modified) at ``revision``."""
    return Stored(record, create_revision=revision, mod_revision=revision, lease=lease)


def waiter(job: str, revision: int, priority: int = 0, session: str = "") -> QueuedJob:
    """A queue entry of ``job`` created at ``revision``."""
    entry = QueueRecord(session=session or f"s-{job}", priority=priority, enqueued_at=1.0)
    return QueuedJob(job, stored(entry, revision, lease=7))


def holder(job: str, revision: int, session: str = "") -> Stored[HolderRecord]:
    """A grant of the group to ``job``, written at ``revision`` (its epoch)."""
    record = HolderRecord(
        job=job,
        session=session or f"s-{job}",
        granted_at=2.0,
        waited_seconds=0.5,
        restored=True,
        previous_job="x",
        switch_seconds=0.25,
    )
    return stored(record, revision)


def switch_to(job: str, to_revision: int, revision: int) -> Stored[SwitchRecord]:
    """A switch record towards ``job``'s queue entry ``to_revision``, written at ``revision``."""
    record = SwitchRecord(
        switch_id="sw",
        group=GROUP,
        to_job=job,
        to_revision=to_revision,
        steps=[NodeStep(node="n1", evict="", restore=job)],
        phase=SwitchPhase.CHECKPOINT,
        driver="r1",
        started_at=3.0,
    )
    return stored(record, revision)


def view(
    queue: list[QueuedJob] | None = None,
    *,
    holding: Stored[HolderRecord] | None = None,
    resident: dict[str, list[str]] | None = None,
    switch: Stored[SwitchRecord] | None = None,
    faults: dict[str, tuple[str, int]] | None = None,
    members: list[str] | None = None,
    held: dict[str, float] | None = None,
    revision: int = 1000,
) -> GroupView:
    """A view of group ``g``: ``faults`` maps job -> (reason, revision), ``held`` job -> seconds
    in the usage ledger."""
    usage = None
    if held is not None:
        ledger = UsageRecord({job: JobUsageRecord(held_seconds=s) for job, s in held.items()})
        usage = stored(ledger, 5)
    return GroupView(
        group=GROUP,
        revision=revision,
        exists=True,
        holder=holding,
        # The mirror hands the queue over in FIFO order (by create revision).
        queue=sorted(queue or [], key=lambda q: q.revision),
        resident=stored(ResidentRecord(dict(resident)), 4) if resident is not None else None,
        switch=switch,
        driver="r1",
        driver_lease=7,
        faults={
            job: stored(FaultRecord(reason=reason, at=1.0), rev)
            for job, (reason, rev) in (faults or {}).items()
        },
        static_members=list(members or []),
        usage=usage,
    )


def agent(
    node: str,
    jobs: dict[str, int],
    *,
    group: str = GROUP,
    capacity: int = 0,
    default_bytes: int = 0,
) -> AgentRecord:
    """An agent on ``node`` whose workers of ``group`` announce ``jobs``: job -> state bytes."""
    workers = [WorkerRecord(job=j, group=group, pid=100 + i, state_bytes=b) for i, (j, b) in
               enumerate(jobs.items())]  # fmt: skip
    return AgentRecord(
        node=node,
        replica="r1",
        backend="sim",
        emulated=True,
        connected_at=1.0,
        workers=workers,
        capacity_bytes=capacity,
        default_state_bytes=default_bytes,
    )


def agents(*records: AgentRecord) -> dict[str, AgentRecord]:
    """Agent records by node, as the mirror returns them."""
    return {a.node: a for a in records}
