"""Driving a group: the driver key, switch records, grants, and giving up on a waiter.

One replica at a time drives a group's switches: the one whose lease the ``driver`` key is
attached to. Every write here compares that lease (not the replica's name: a restarted
replica reusing its name must not inherit the authority of its previous incarnation), so a
paused or partitioned driver whose lease ran out cannot land a write when it wakes.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass

from timeslice_orchestrator.store.base import StoreBase
from timeslice_orchestrator.store.etcd import (
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    Get,
    Op,
    Put,
    Txn,
    absent,
    created_at,
    modified_at,
    present,
)
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import (
    FaultRecord,
    GroupStats,
    HolderRecord,
    OperationRecord,
    OperationState,
    QueuedJob,
    ResidentRecord,
    Stored,
    SwitchPhase,
    SwitchRecord,
)


def new_switch_id() -> str:
    return uuid.uuid4().hex[:12]


def grant_txn(keys: Keyspace, auth: Authority | None, grant: Grant, holder: Compare) -> Txn:
    """The transaction of ``grant``, with ``holder`` as its compare on the holder key (the key
    absent, or the hold a hand-over overwrites); see :meth:`SwitchStore.grant`."""
    k = keys
    group, job, entry = grant.group, grant.waiter.job, grant.waiter.entry
    compare: list[Compare] = [] if auth is None else [SwitchStore.driving(k, group, auth)]
    if grant.stats_revision is not None:
        compare.append(modified_at(k.stats(group), grant.stats_revision))
    elif auth is None:
        raise ValueError("a grant by a replica that does not drive must compare the stats")
    compare += [
        holder,
        modified_at(k.queue_entry(group, job), entry.mod_revision),
        modified_at(k.resident(group), grant.resident_revision),
    ]
    ops: list[Op] = [
        Put(k.holder(group), grant.holder.encode(), lease=entry.lease),
        Delete(k.queue_entry(group, job)),
        Put(k.stats(group), grant.stats.encode()),
    ]
    if grant.resident is not None:
        ops.append(Put(k.resident(group), grant.resident.encode()))
    if grant.switch is not None:
        compare.append(modified_at(k.switch(group), grant.switch.mod_revision))
        ops.append(Delete(k.switch(group)))
    else:
        compare.append(absent(k.switch(group)))
    return Txn(compare, ops)


@dataclass(frozen=True, slots=True)
class Authority:
    """Who may drive a group: a replica incarnation, identified by its etcd lease."""

    replica_id: str
    lease: int


@dataclass(frozen=True, slots=True)
class Grant:
    """A hand-over as it commits: the waiter served and what the group looks like after it."""

    group: str
    waiter: QueuedJob  # the queue entry served, as read: a waiter that re-attached since waits
    holder: HolderRecord  # the new hold; its epoch is the revision of the grant's write
    # The residency after the hand-over; None: as it was (compared, not written again).
    resident: ResidentRecord | None
    resident_revision: int  # mod revision of the residency it was computed from (0: none)
    stats: GroupStats
    switch: Stored[SwitchRecord] | None = None  # the switch it ends; None: a grant in place
    # Mod revision of the stats it was computed from: compared when the grant is made by a
    # replica that does not drive the group (a yield handing over), so that it cannot
    # overwrite what the driver wrote meanwhile. None: not compared (the driver's own writes).
    stats_revision: int | None = None


@dataclass(frozen=True, slots=True)
class Fault:
    """Giving up on a waiter: its queue entry goes and a record (on its lease) says why."""

    waiter: QueuedJob
    reason: str


class SwitchStore(StoreBase):
    """The driver's transactions, each fenced by the driver key's lease."""

    async def claim_driver(self, group: str, auth: Authority) -> bool:
        """Become (or stay) the replica that drives this group's switches."""
        k = self.keys
        result = await self.etcd.txn(
            Txn(
                compare=[absent(k.driver(group))],
                success=[Put(k.driver(group), auth.replica_id.encode(), lease=auth.lease)],
                failure=[Get(k.driver(group))],
            )
        )
        if result.succeeded:
            return True
        current = result.reads[0]
        return bool(current) and current[0].lease == auth.lease

    def _driving(self, group: str, auth: Authority) -> Compare:
        return self.driving(self.keys, group, auth)

    @staticmethod
    def driving(keys: Keyspace, group: str, auth: Authority) -> Compare:
        """The compare every driver write carries: ``auth``'s lease holds the driver key."""
        return Compare(keys.driver(group), CompareTarget.LEASE, CompareOp.EQUAL, auth.lease)

    def _close_operation(self, group: str, outcome: Stored[OperationRecord] | None) -> list[Op]:
        """Write an operation's outcome, if its record is still there (it may have expired:
        that must not keep the switch from closing)."""
        if outcome is None:
            return []
        key = self.keys.operation(group, outcome.record.operation_id)
        return [Txn([present(key)], [Put(key, outcome.record.encode(), lease=outcome.lease)])]

    async def grant(self, auth: Authority | None, grant: Grant) -> int | None:
        """Commit point: resident, holder (with a new epoch) and queue change in one txn.

        ``auth`` None is a grant in place by a replica that need not drive the group (the
        one that served the yield): it moves no data, so it needs no driver role, only the
        group exactly as read (no switch, same residency and stats).

        Returns the epoch (the holder key's create revision) or None if a compare failed
        (the waiter left or re-attached, another replica drives, or the group changed).
        """
        txn = grant_txn(self.keys, auth, grant, absent(self.keys.holder(grant.group)))
        # Batched: a hold's epoch is compared only within its group (never with a fence).
        result = await self.etcd.txn(txn, batch=grant.group)
        return result.revision if result.succeeded else None

    async def begin_switch(
        self,
        group: str,
        auth: Authority,
        record: SwitchRecord,
        resident_revision: int,
        holder_revision: int = 0,
        operation: Stored[OperationRecord] | None = None,
    ) -> Stored[SwitchRecord] | None:
        """Write the switch record; its create revision is the epoch of every directive.

        A switch needs the group free (``holder_revision`` 0); a prefetch runs beside the
        holder it names by revision, and never touches that holder's state. With
        ``operation`` (PENDING, as read) the switch carries out that operator operation,
        which becomes RUNNING in the same transaction.
        """
        k = self.keys
        compare = [
            self._driving(group, auth),
            absent(k.switch(group)),
            modified_at(k.holder(group), holder_revision),
            modified_at(k.resident(group), resident_revision),
        ]
        ops: list[Op] = [Put(k.switch(group), record.encode()), Get(k.switch(group))]
        if operation is not None:
            key = k.operation(group, operation.record.operation_id)
            running = dataclasses.replace(
                operation.record, state=OperationState.RUNNING, switch_id=record.switch_id
            )
            compare.append(modified_at(key, operation.mod_revision))
            ops.append(Put(key, running.encode(), lease=operation.lease))
        result = await self.etcd.txn(Txn(compare, ops))
        if not result.succeeded:
            return None
        return Stored.of(result.reads[0][0], record)

    async def update_switch(
        self,
        group: str,
        auth: Authority,
        switch: Stored[SwitchRecord],
        phase: SwitchPhase,
        evicted_bytes: int | None = None,
    ) -> Stored[SwitchRecord] | None:
        """Move the switch to ``phase`` (noting the bytes its checkpoints moved, if given);
        None if it changed or this replica no longer drives."""
        k = self.keys
        # A new record: the one read may be shared with the mirror, which must not change
        # under it.
        record = dataclasses.replace(switch.record, phase=phase)
        if evicted_bytes is not None:
            record.evicted_bytes = evicted_bytes
        result = await self.etcd.txn(
            Txn(
                [self._driving(group, auth), modified_at(k.switch(group), switch.mod_revision)],
                [Put(k.switch(group), record.encode()), Get(k.switch(group))],
            )
        )
        if not result.succeeded:
            return None
        return Stored.of(result.reads[0][0], record)

    async def end_switch(
        self,
        group: str,
        auth: Authority,
        switch: Stored[SwitchRecord],
        resident: ResidentRecord,
        stats: GroupStats,
        fault: Fault | None = None,
        resident_revision: int | None = None,
        operation: Stored[OperationRecord] | None = None,
    ) -> int | None:
        """Close a switch without a grant (aborted, the waiter left mid-switch, a prefetch,
        a catch-up, or an operator operation).

        Returns the revision of the write, or None if a compare failed.

        With ``fault``, the waiter whose switch failed for good is given up on as well. With
        ``resident_revision`` (that of the residency ``resident`` was computed from), it fails
        if the residency changed since: a node fenced out meanwhile stays unknown. With
        ``operation`` (its outcome, on its lease), the operation the switch carried out is
        closed in the same transaction, so its outcome and the residency never disagree.
        """
        k = self.keys
        ops: list[Op] = [
            Delete(k.switch(group)),
            Put(k.resident(group), resident.encode()),
            Put(k.stats(group), stats.encode()),
            *self._close_operation(group, operation),
        ]
        if fault is not None:
            ops += self._give_up(group, fault)
        compare = [self._driving(group, auth), modified_at(k.switch(group), switch.mod_revision)]
        if resident_revision is not None:
            compare.append(modified_at(k.resident(group), resident_revision))
        result = await self.etcd.txn(Txn(compare, ops))
        return result.revision if result.succeeded else None

    async def fault_waiter(
        self, group: str, auth: Authority, fault: Fault, stats: GroupStats
    ) -> int | None:
        """Give up on a waiter (the entry it had when the driver decided) and say why.

        Returns the revision of the write, or None if a compare failed.
        """
        entry = self.keys.queue_entry(group, fault.waiter.job)
        result = await self.etcd.txn(
            Txn(
                [self._driving(group, auth), created_at(entry, fault.waiter.revision)],
                [*self._give_up(group, fault), Put(self.keys.stats(group), stats.encode())],
            )
        )
        return result.revision if result.succeeded else None

    def _give_up(self, group: str, fault: Fault) -> list[Op]:
        # The record lives on the waiter's session lease: it goes when the client does.
        k = self.keys
        job = fault.waiter.job
        record = FaultRecord(reason=fault.reason, at=time.time())
        return [
            Delete(k.queue_entry(group, job)),
            Put(k.fault(group, job), record.encode(), lease=fault.waiter.entry.lease),
        ]
