"""The transactions that change sessions, queues, holds and switches.

Each method is one etcd transaction (or a read then one transaction) whose compares carry the
whole authority for the change: a stale replica's write fails its compare instead of landing.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

from timeslice.errors import (
    AlreadyExists,
    NotFound,
    NotHolder,
    PermissionDenied,
    SessionExpired,
    Unavailable,
)
from timeslice_orchestrator.store.etcd import (
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    EtcdClient,
    Get,
    KeyValue,
    LeaseExpired,
    Op,
    Put,
    Txn,
    absent,
    created_at,
    modified_at,
    present,
    value_is,
)
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import (
    AgentRecord,
    FaultRecord,
    GroupStats,
    HolderRecord,
    MembersRecord,
    Phase,
    QueueRecord,
    RelayRecord,
    ResidentRecord,
    SessionRecord,
    Stored,
    SwitchRecord,
    UsageRecord,
)

_REATTACH_TRIES = 5


def session_id_of(lease_id: int) -> str:
    return f"{lease_id:016x}"


def lease_of(session_id: str) -> int:
    try:
        value = int(session_id, 16)
    except ValueError:
        value = 0
    if len(session_id) != 16 or value <= 0:
        raise NotFound(f"session {session_id!r} does not exist")
    return value


@dataclass(frozen=True, slots=True)
class Authority:
    """Who may drive a group: a replica incarnation, identified by its etcd lease."""

    replica_id: str
    lease: int


@dataclass(frozen=True, slots=True)
class Enqueued:
    revision: int  # the store revision after the enqueue
    entry_revision: int  # create revision of the queue entry: the job's place in line
    attempt: str  # this Acquire call's stamp on the entry (or hold)
    entry_value: bytes  # the entry as this attempt wrote it ("" when re-attached to a grant)
    reattached: bool


class GroupStore:
    def __init__(self, etcd: EtcdClient, keys: Keyspace) -> None:
        self.etcd = etcd
        self.keys = keys

    # -- sessions -----------------------------------------------------------------------

    async def open_session(self, job: str, ttl: int, host: str, pid: int) -> str:
        lease = await self.etcd.grant_lease(ttl)
        sid = session_id_of(lease)
        record = SessionRecord(job=job, host=host, pid=pid, opened_at=time.time())
        await self.etcd.put(self.keys.session(sid), record.encode(), lease=lease)
        return sid

    async def session(self, session_id: str) -> Stored[SessionRecord]:
        lease_of(session_id)
        kv = await self.etcd.get(self.keys.session(session_id))
        if kv is None:
            raise SessionExpired(f"session {session_id} has expired or was closed")
        return Stored.of(kv, SessionRecord.decode(kv.value))

    async def keepalive(self, session_id: str) -> int:
        try:
            return await self.etcd.keepalive_once(lease_of(session_id))
        except LeaseExpired as exc:
            raise SessionExpired(f"session {session_id} has expired") from exc

    async def close_session(self, session_id: str) -> None:
        await self.etcd.revoke_lease(lease_of(session_id))

    # -- the lock -----------------------------------------------------------------------

    async def enqueue(
        self,
        session: Stored[SessionRecord],
        session_id: str,
        group: str,
        priority: int,
        request_id: str = "",
        attempt: str = "",
        holder_hint: KeyValue | None = None,
        hint_given: bool = False,
    ) -> Enqueued:
        """Put the job in the group's queue; creates the group on first use.

        Re-acquiring with the same session re-attaches to the existing entry (its place in
        line is kept), and a retry of the same request (same ``request_id``) that finds the
        grant already committed re-attaches to the grant; the job already holding the group,
        or waiting through another session, is refused. Re-attaching stamps ``attempt`` (one
        per Acquire call a replica serves) on the entry or hold, so that the clean-up of an
        abandoned earlier attempt on another replica cannot take them away.
        """
        for _ in range(_REATTACH_TRIES):
            enqueued = await self._enqueue_once(
                session, session_id, group, priority, request_id, attempt, holder_hint, hint_given
            )
            if enqueued is not None:
                return enqueued
            hint_given = False  # raced: read the holder afresh
        raise Unavailable(f"group {group} changed too fast to queue job {session.record.job}")

    async def _enqueue_once(
        self,
        session: Stored[SessionRecord],
        session_id: str,
        group: str,
        priority: int,
        request_id: str,
        attempt: str,
        hint: KeyValue | None,
        hint_given: bool,
    ) -> Enqueued | None:
        """One try; None when the group changed underneath (the caller tries again).

        With ``hint_given``, ``hint`` is the holder key as the mirror has it (None: no
        holder) instead of a fresh read; the transaction compares the holder's revision
        either way, so a stale hint costs a retry, never a wrong answer.
        """
        job = session.record.job
        k = self.keys
        holder = hint if hint_given else await self.etcd.get(k.holder(group))
        if holder is not None:
            held = HolderRecord.decode(holder.value)
            if held.job == job and hint_given:
                return None  # the mirror may lag our own yield: decide on a fresh read
            if held.job == job:
                if request_id and held.request_id == request_id and held.session == session_id:
                    held.attempt = attempt
                    value = held.encode()
                    taken = await self.etcd.txn(
                        Txn(
                            [modified_at(k.holder(group), holder.mod_revision)],
                            [Put(k.holder(group), value, lease=holder.lease)],
                        )
                    )
                    if not taken.succeeded:
                        return None
                    return Enqueued(taken.revision, held.ticket, attempt, b"", reattached=True)
                raise AlreadyExists(f"job {job} already holds group {group}")
        entry = QueueRecord(
            session=session_id,
            priority=priority,
            enqueued_at=time.time(),
            request_id=request_id,
            attempt=attempt,
        )
        value = entry.encode()
        result = await self.etcd.txn(
            Txn(
                compare=[
                    absent(k.queue_entry(group, job)),
                    present(k.session(session_id)),
                    modified_at(k.holder(group), holder.mod_revision if holder else 0),
                ],
                success=[
                    Put(k.queue_entry(group, job), value, lease=session.lease),
                    Delete(k.fault(group, job)),
                    Txn([absent(k.meta(group))], [Put(k.meta(group), b"{}")]),
                ],
                failure=[Get(k.queue_entry(group, job)), Get(k.session(session_id))],
            )
        )
        if result.succeeded:
            return Enqueued(result.revision, result.revision, attempt, value, reattached=False)
        existing, sessions = result.reads
        if not sessions:
            raise SessionExpired(f"session {session_id} has expired or was closed")
        if not existing:
            return None  # the holder changed since we looked
        current = existing[0]
        record = QueueRecord.decode(current.value)
        if record.session != session_id:
            raise AlreadyExists(f"job {job} already waits for group {group} in another session")
        record.attempt = attempt
        value = record.encode()
        taken = await self.etcd.txn(
            Txn(
                [modified_at(k.queue_entry(group, job), current.mod_revision)],
                [Put(k.queue_entry(group, job), value, lease=current.lease)],
            )
        )
        if not taken.succeeded:
            return None
        return Enqueued(taken.revision, current.create_revision, attempt, value, reattached=True)

    async def withdraw(self, group: str, job: str, session_id: str, enqueued: Enqueued) -> bool:
        """Cancel-safe exit of a waiter: drop its queue entry, or the grant that raced it.

        Only what this attempt still owns goes: an entry or hold that a later attempt (a
        client that moved to another replica) re-attached to is left alone. Returns True
        when a grant had to be given back.
        """
        k = self.keys
        result = await self.etcd.txn(
            Txn(
                compare=[value_is(k.queue_entry(group, job), enqueued.entry_value)],
                success=[Delete(k.queue_entry(group, job))],
                failure=[Get(k.holder(group))],
            )
        )
        if result.succeeded or not result.reads[0]:
            return False
        holder = result.reads[0][0]
        record = HolderRecord.decode(holder.value)
        if record.job != job or record.session != session_id:
            return False
        if record.attempt != enqueued.attempt or holder.create_revision < enqueued.entry_revision:
            return False
        released = await self.etcd.txn(
            Txn([modified_at(k.holder(group), holder.mod_revision)], [Delete(k.holder(group))])
        )
        return released.succeeded

    async def release(
        self,
        group: str,
        job: str,
        epoch: int,
        session_id: str,
        hint: KeyValue | None = None,
        usage: KeyValue | None = None,
    ) -> None:
        """Yield: compare-and-delete the holder key. Moves no data (lazy switching).

        ``hint`` is the holder key as a mirror last saw it; when it matches the epoch it saves
        the read, and the compare on its mod revision keeps the delete exact either way.
        """
        k = self.keys
        holder = hint if hint is not None and hint.create_revision == epoch else None
        if holder is None:
            holder = await self.etcd.get(k.holder(group))
        if holder is None:
            if await self.etcd.get(k.meta(group)) is None:
                raise NotFound(f"group {group} does not exist")
            raise NotHolder(f"job {job} does not hold group {group} (nobody does)")
        record = HolderRecord.decode(holder.value)
        if record.job != job:
            raise PermissionDenied(f"group {group} is held by another job, not {job}")
        if holder.create_revision != epoch:
            raise NotHolder(
                f"epoch {epoch} does not match: job {job} holds group {group} "
                f"under epoch {holder.create_revision}"
            )
        if session_id and record.session != session_id:
            raise PermissionDenied(f"the hold on {group} belongs to another session of {job}")
        # The hold ends and its time goes into the group's usage ledger in one transaction.
        usage_kv = await self.etcd.get(k.usage(group)) if usage is None else usage
        ledger = UsageRecord.decode(usage_kv.value) if usage_kv is not None else UsageRecord()
        ledger.add(job, record.granted_at, time.time())
        result = await self.etcd.txn(
            Txn(
                [
                    modified_at(k.holder(group), holder.mod_revision),
                    modified_at(k.usage(group), usage_kv.mod_revision if usage_kv else 0),
                ],
                [Delete(k.holder(group)), Put(k.usage(group), ledger.encode())],
                [Get(k.holder(group))],
            )
        )
        if result.succeeded:
            return
        current = result.reads[0]
        if current and current[0].mod_revision == holder.mod_revision:
            # Only the ledger moved (a stale copy): read it afresh and try once more.
            return await self.release(group, job, epoch, session_id, holder, None)
        raise NotHolder(f"job {job} lost its hold on {group} (session expired?)")

    # -- the switch driver --------------------------------------------------------------

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

    def _driving(self, group: str, auth: Authority) -> list[Compare]:
        # The lease, not the name: a restarted replica reusing its name must not inherit
        # the authority of its previous incarnation (a paused zombie could still write).
        return [Compare(self.keys.driver(group), CompareTarget.LEASE, CompareOp.EQUAL, auth.lease)]

    async def grant(
        self,
        group: str,
        auth: Authority,
        entry: Stored[QueueRecord],
        job: str,
        holder: HolderRecord,
        resident: ResidentRecord,
        resident_revision: int,
        switch: Stored[SwitchRecord] | None,
        stats: GroupStats,
    ) -> int | None:
        """Commit point: resident, holder (with a new epoch) and queue change in one txn.

        Returns the epoch (the holder key's create revision) or None if a compare failed
        (the waiter left, another replica drives, or the group changed underneath).
        """
        k = self.keys
        compare = [
            *self._driving(group, auth),
            absent(k.holder(group)),
            # The entry as read: a waiter that re-attached since gets the next pass instead.
            modified_at(k.queue_entry(group, job), entry.mod_revision),
            modified_at(k.resident(group), resident_revision),
        ]
        ops: list[Op] = [
            Put(k.holder(group), holder.encode(), lease=entry.lease),
            Delete(k.queue_entry(group, job)),
            Put(k.resident(group), resident.encode()),
            Put(k.stats(group), stats.encode()),
        ]
        if switch is not None:
            compare.append(modified_at(k.switch(group), switch.mod_revision))
            ops.append(Delete(k.switch(group)))
        else:
            compare.append(absent(k.switch(group)))
        result = await self.etcd.txn(Txn(compare, ops))
        return result.revision if result.succeeded else None

    async def begin_switch(
        self,
        group: str,
        auth: Authority,
        record: SwitchRecord,
        resident_revision: int,
        holder_revision: int = 0,
    ) -> Stored[SwitchRecord] | None:
        """Write the switch record; its create revision is the epoch of every directive.

        A switch needs the group free (``holder_revision`` 0); a prefetch runs beside the
        holder it names by revision, and never touches that holder's state.
        """
        k = self.keys
        result = await self.etcd.txn(
            Txn(
                [
                    *self._driving(group, auth),
                    absent(k.switch(group)),
                    modified_at(k.holder(group), holder_revision),
                    modified_at(k.resident(group), resident_revision),
                ],
                [Put(k.switch(group), record.encode()), Get(k.switch(group))],
            )
        )
        if not result.succeeded:
            return None
        kv = result.reads[0][0]
        return Stored.of(kv, record)

    async def update_switch(
        self, group: str, auth: Authority, switch: Stored[SwitchRecord], phase: Phase
    ) -> Stored[SwitchRecord] | None:
        k = self.keys
        switch.record.phase = phase
        result = await self.etcd.txn(
            Txn(
                [*self._driving(group, auth), modified_at(k.switch(group), switch.mod_revision)],
                [Put(k.switch(group), switch.record.encode()), Get(k.switch(group))],
            )
        )
        if not result.succeeded:
            return None
        return Stored.of(result.reads[0][0], switch.record)

    async def end_switch(
        self,
        group: str,
        auth: Authority,
        switch: Stored[SwitchRecord],
        resident: ResidentRecord,
        stats: GroupStats,
        fault: tuple[str, Stored[QueueRecord], str] | None = None,
    ) -> bool:
        """Close a switch without a grant (aborted, or the waiter left mid-switch).

        ``fault`` = (job, its queue entry, reason) isolates a job whose switch failed for
        good: its queue entry goes and a fault record tells its waiter why.
        """
        k = self.keys
        compare = [
            *self._driving(group, auth),
            modified_at(k.switch(group), switch.mod_revision),
        ]
        ops: list[Put | Delete] = [
            Delete(k.switch(group)),
            Put(k.resident(group), resident.encode()),
            Put(k.stats(group), stats.encode()),
        ]
        if fault is not None:
            job, entry, reason = fault
            ops.append(Delete(k.queue_entry(group, job)))
            ops.append(
                Put(
                    k.fault(group, job),
                    FaultRecord(reason=reason, at=time.time()).encode(),
                    lease=entry.lease,
                )
            )
        result = await self.etcd.txn(Txn(compare, ops))
        return result.succeeded

    async def fault_waiter(
        self,
        group: str,
        auth: Authority,
        job: str,
        entry: Stored[QueueRecord],
        reason: str,
        stats: GroupStats,
    ) -> bool:
        """Give up on a waiter: its queue entry goes and a fault record tells it why."""
        k = self.keys
        result = await self.etcd.txn(
            Txn(
                [
                    *self._driving(group, auth),
                    created_at(k.queue_entry(group, job), entry.create_revision),
                ],
                [
                    Delete(k.queue_entry(group, job)),
                    Put(
                        k.fault(group, job),
                        FaultRecord(reason=reason, at=time.time()).encode(),
                        lease=entry.lease,
                    ),
                    Put(k.stats(group), stats.encode()),
                ],
            )
        )
        return result.succeeded

    async def set_members(self, group: str, nodes: list[str]) -> int:
        """Pin (or, with no nodes, unpin) the nodes a group always spans; creates the group.

        Returns the store revision after the change.
        """
        k = self.keys
        # Always a write (an empty list unpins), so the revision returned is this change's.
        change = Put(k.members(group), MembersRecord(sorted(set(nodes))).encode())
        result = await self.etcd.txn(
            Txn([], [change, Txn([absent(k.meta(group))], [Put(k.meta(group), b"{}")])])
        )
        return result.revision

    # -- agents -------------------------------------------------------------------------

    async def forget_residency(self, group: str, node: str, job: str) -> bool:
        """Record that ``job``'s state is no longer on ``node``'s devices (an agent said so)."""
        k = self.keys
        current = await self.etcd.get(k.resident(group))
        if current is None:
            return False
        record = ResidentRecord.decode(current.value)
        if job not in record.nodes.get(node, []):
            return False
        record.remove(node, job)
        result = await self.etcd.txn(
            Txn(
                [modified_at(k.resident(group), current.mod_revision)],
                [Put(k.resident(group), record.encode())],
            )
        )
        return result.succeeded

    async def agent_lease(self, node: str, ttl: int) -> int:
        """The lease that keeps ``node``'s agent record: the existing one while it lives.

        Agent records outlive the stream that published them by up to ``ttl`` seconds, so an
        agent that reconnects to another replica stays a member of its groups throughout.
        """
        current = await self.etcd.get(self.keys.agent(node))
        if current is not None and current.lease:
            try:
                await self.etcd.keepalive_once(current.lease)
                return current.lease
            except LeaseExpired:
                pass
        return await self.etcd.grant_lease(ttl)

    async def publish_agent(self, record: AgentRecord, lease: int) -> None:
        await self.etcd.put(self.keys.agent(record.node), record.encode(), lease=lease)

    async def remove_agent(self, node: str, lease: int) -> None:
        """Drop the agent's record now (a clean goodbye), if it is still the one we wrote."""
        k = self.keys
        current = await self.etcd.get(k.agent(node))
        if current is None or current.lease != lease:
            return
        await self.etcd.txn(
            Txn([modified_at(k.agent(node), current.mod_revision)], [Delete(k.agent(node))])
        )


def new_switch_id() -> str:
    return uuid.uuid4().hex[:12]


def raw(kv: KeyValue | None) -> bytes:
    return kv.value if kv else b""


class RelayStore:
    """Directives relayed through etcd between the driving replica and the stream holder."""

    def __init__(self, etcd: EtcdClient, keys: Keyspace) -> None:
        self.etcd = etcd
        self.keys = keys

    async def post(self, node: str, directive_id: str, record: RelayRecord, lease: int) -> bool:
        key = self.keys.relay(node, directive_id)
        result = await self.etcd.txn(Txn([absent(key)], [Put(key, record.encode(), lease=lease)]))
        return result.succeeded

    async def answer(self, node: str, directive_id: str, posted: KeyValue, ack: str) -> bool:
        """Attach the ack, unless the driver gave up (deleted the key) meanwhile."""
        key = self.keys.relay(node, directive_id)
        record = RelayRecord.decode(posted.value)
        record.ack = ack
        result = await self.etcd.txn(
            Txn(
                [modified_at(key, posted.mod_revision)],
                [Put(key, record.encode(), lease=posted.lease)],
            )
        )
        return result.succeeded

    async def remove(self, node: str, directive_id: str) -> None:
        await self.etcd.delete(self.keys.relay(node, directive_id))
