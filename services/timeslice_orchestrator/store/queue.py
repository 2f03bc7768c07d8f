"""A group's queue and its hold: enqueue (Acquire), withdraw (a waiter leaving), release (Yield).

The queue is a set of keys ``groups/<g>/queue/<job>`` ordered by create revision and attached
to the waiters' session leases; the hold is ``groups/<g>/holder``, attached to the holder's
session, and its create revision is the fencing epoch (or the revision of the hand-over
that wrote it: :func:`~timeslice_orchestrator.store.records.hold_epoch`). Every change here is
one transaction whose compares carry its whole authority (the session still exists, the
holder is the one read), so a stale read costs a retry, never a wrong answer.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TypeVar

from timeslice.errors import (
    AlreadyExists,
    NotFound,
    NotHolder,
    PermissionDenied,
    SessionExpired,
    Unavailable,
)
from timeslice_orchestrator.store.base import StoreBase
from timeslice_orchestrator.store.etcd import (
    Delete,
    Get,
    KeyValue,
    Put,
    Txn,
    absent,
    modified_at,
    none_under,
    present,
    value_is,
)
from timeslice_orchestrator.store.records import (
    GroupStats,
    Hint,
    HolderRecord,
    QueueRecord,
    ResidentRecord,
    SessionRecord,
    Stored,
    UsageRecord,
    hold_epoch,
)

# Tries of an enqueue whose group keeps changing between its read and its transaction.
_ENQUEUE_TRIES = 5
# Releases tried while what they compare keeps moving (a ledger or a re-stamp).
_RELEASE_TRIES = 5

_Stamped = TypeVar("_Stamped", QueueRecord, HolderRecord)


@dataclass(frozen=True, slots=True)
class EnqueueRequest:
    """One Acquire call, as the store needs it."""

    session: Stored[SessionRecord]  # the caller's session as read: its lease keeps the entry
    session_id: str
    group: str
    priority: int
    request_id: str = ""  # the client's name for the call, the same on its retries
    attempt: str = ""  # this replica's stamp for the call: one per Acquire it serves
    # The Acquire's span (W3C trace context), kept in the queue entry for the switch's link.
    trace_context: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def job(self) -> str:
        return self.session.record.job


@dataclass(frozen=True, slots=True)
class Enqueued:
    """Where an enqueue left the job."""

    request: EnqueueRequest
    revision: int  # the store revision after the enqueue
    entry_revision: int  # create revision of the queue entry: the job's place in line
    entry_value: bytes  # the entry as this attempt wrote it (b"" when it wrote none)
    reattached: bool
    epoch: int = 0  # granted in the same transaction: the hold's epoch

    @property
    def attempt(self) -> str:
        return self.request.attempt


@dataclass(frozen=True, slots=True)
class FreeGroup:
    """A group this replica's mirror saw free with nobody waiting, and the grant it calls for.

    The revisions are compared, so the grant lands only if the group is still as seen; the
    records are what the group looks like after the grant.
    """

    ticket: int  # the revision the group was seen free at: the grant's place in line
    # The residency after the grant (the job's nodes most recent); None: as it was (compared,
    # not written again).
    resident: ResidentRecord | None
    resident_revision: int  # mod revisions as seen (0: the key is absent)
    stats: GroupStats  # the counters after the grant
    stats_revision: int
    members_revision: int


@dataclass(frozen=True, slots=True)
class Hold:
    """A grant as its client names it to give it back."""

    group: str
    job: str
    epoch: int  # the fencing token (records.hold_epoch)
    # "" accepts the hold of any session of the job: the operator yield, which the client
    # API allows only to an operator (every other caller names its session and its secret).
    session_id: str = ""


class QueueStore(StoreBase):
    """The transactions of Acquire, of a waiter leaving, and of Yield."""

    async def enqueue(
        self, request: EnqueueRequest, holder: Hint[Stored[HolderRecord]] | None = None
    ) -> Enqueued:
        """Put the job in the group's queue; creates the group on first use.

        Re-acquiring with the same session re-attaches to the existing entry (its place in
        line is kept), and a retry of the same request (same ``request_id``) that finds the
        grant already committed re-attaches to the grant; the job already holding the group,
        or waiting through another session, is refused. Re-attaching stamps the request's
        ``attempt`` on the entry or hold, so that the clean-up of an abandoned earlier attempt
        on another replica cannot take them away. ``holder`` saves reading the holder key.
        """
        for _ in range(_ENQUEUE_TRIES):
            enqueued = await self._enqueue_once(request, holder)
            if enqueued is not None:
                return enqueued
            holder = None  # raced: read the holder afresh
        raise Unavailable(f"group {request.group} changed too fast to queue job {request.job}")

    async def _enqueue_once(
        self, req: EnqueueRequest, hint: Hint[Stored[HolderRecord]] | None
    ) -> Enqueued | None:
        """One try; None when the group changed underneath (the caller tries again)."""
        k = self.keys
        group, job = req.group, req.job
        holder = hint.seen if hint is not None else await self._holder(group)
        if holder is not None and holder.record.job == job:
            if hint is not None:
                return None  # the mirror may lag our own yield: decide on a fresh read
            return await self._reattach_to_grant(req, holder)
        entry = QueueRecord(
            session=req.session_id,
            priority=req.priority,
            enqueued_at=time.time(),
            request_id=req.request_id,
            attempt=req.attempt,
            trace_context=req.trace_context,
        )
        value = entry.encode()
        result = await self.etcd.txn(
            Txn(
                compare=[
                    absent(k.queue_entry(group, job)),
                    present(k.session(req.session_id)),
                    modified_at(k.holder(group), holder.mod_revision if holder else 0),
                ],
                success=[
                    Put(k.queue_entry(group, job), value, lease=req.session.lease),
                    Delete(k.fault(group, job)),
                    self._create_group(group, job),
                ],
                failure=[Get(k.queue_entry(group, job)), Get(k.session(req.session_id))],
            ),
            batch=group,
        )
        if result.succeeded:
            return Enqueued(req, result.revision, result.revision, value, reattached=False)
        existing, sessions = result.reads
        if not sessions:
            raise SessionExpired(f"session {req.session_id} has expired or was closed")
        if not existing:
            return None  # the holder changed since we looked
        current = existing[0]
        queued = Stored.of(current, QueueRecord.decode(current.value))
        if queued.record.session != req.session_id:
            raise AlreadyExists(f"job {job} already waits for group {group} in another session")
        # The Acquire now waiting is this one: the switch that serves it links to its span.
        restamped = dataclasses.replace(
            queued.record, attempt=req.attempt, trace_context=req.trace_context
        )
        stamped = await self._restamp(k.queue_entry(group, job), queued, restamped)
        if stamped is None:
            return None
        revision, value = stamped
        return Enqueued(req, revision, current.create_revision, value, reattached=True)

    async def take_free(self, request: EnqueueRequest, free: FreeGroup) -> Enqueued | None:
        """Acquire a free group nobody waits for in one transaction: the grant the driver
        would make for a lone waiter whose state needs no moving, without the queue entry
        and the hop to the driver. Creates the group on first use.

        None when the group is no longer as seen (the caller enqueues instead). The ticket is
        the revision the group was seen free at: no grant since (every grant writes the
        stats), so it is above every earlier grant's ticket and below every later waiter's.
        """
        k = self.keys
        group, job = request.group, request.job
        now = time.time()
        holder = HolderRecord(
            job=job,
            session=request.session_id,
            granted_at=now,
            request_id=request.request_id,
            attempt=request.attempt,
            ticket=free.ticket,
        )
        result = await self.etcd.txn(
            Txn(
                compare=[
                    present(k.session(request.session_id)),
                    absent(k.holder(group)),
                    absent(k.switch(group)),
                    none_under(k.queue(group)),
                    modified_at(k.resident(group), free.resident_revision),
                    modified_at(k.stats(group), free.stats_revision),
                    modified_at(k.members(group), free.members_revision),
                ],
                success=[
                    Put(k.holder(group), holder.encode(), lease=request.session.lease),
                    Put(k.stats(group), free.stats.encode()),
                    Delete(k.fault(group, job)),
                    self._create_group(group, job),
                    *(
                        []
                        if free.resident is None
                        else [Put(k.resident(group), free.resident.encode())]
                    ),
                ],
            ),
            batch=group,
        )
        if not result.succeeded:
            return None
        return Enqueued(
            request, result.revision, free.ticket, b"", reattached=False, epoch=result.revision
        )

    async def _reattach_to_grant(
        self, req: EnqueueRequest, holder: Stored[HolderRecord]
    ) -> Enqueued | None:
        """The job holds the group: a retry of the call that got the grant takes it back."""
        held = holder.record
        if not (
            req.request_id and held.request_id == req.request_id and held.session == req.session_id
        ):
            raise AlreadyExists(f"job {req.job} already holds group {req.group}")
        # The rewrite moves the key's mod revision, which a handed-over hold's epoch was.
        restamped = dataclasses.replace(held, attempt=req.attempt, epoch=hold_epoch(holder))
        stamped = await self._restamp(self.keys.holder(req.group), holder, restamped)
        if stamped is None:
            return None
        # The ticket is the place in line the grant served, as if it had been delivered.
        return Enqueued(req, stamped[0], held.ticket, b"", reattached=True)

    async def _restamp(
        self, key: bytes, seen: Stored[_Stamped], stamped: _Stamped
    ) -> tuple[int, bytes] | None:
        """Re-attach: write ``stamped`` (the entry or hold with the new attempt's stamp) if the
        key is still as read (``seen``).

        Returns the store revision and the value written, or None if the key changed.
        """
        value = stamped.encode()
        taken = await self.etcd.txn(
            Txn([modified_at(key, seen.mod_revision)], [Put(key, value, lease=seen.lease)])
        )
        return (taken.revision, value) if taken.succeeded else None

    async def withdraw(self, enqueued: Enqueued) -> bool:
        """Cancel-safe exit of a waiter: drop its queue entry, or the grant that raced it.

        Only what this attempt still owns goes: an entry or hold that a later attempt (a
        client that moved to another replica) re-attached to is left alone. Returns True
        when a grant had to be given back.
        """
        k = self.keys
        req = enqueued.request
        group, job = req.group, req.job
        result = await self.etcd.txn(
            Txn(
                compare=[value_is(k.queue_entry(group, job), enqueued.entry_value)],
                success=[Delete(k.queue_entry(group, job))],
                failure=[Get(k.holder(group))],
            ),
            batch=group,
        )
        if result.succeeded or not result.reads[0]:
            return False
        holder = result.reads[0][0]
        record = HolderRecord.decode(holder.value)
        if record.job != job or record.session != req.session_id:
            return False
        if record.attempt != enqueued.attempt or _epoch_of(holder) < enqueued.entry_revision:
            return False
        released = await self.etcd.txn(
            Txn([modified_at(k.holder(group), holder.mod_revision)], [Delete(k.holder(group))]),
            batch=group,
        )
        return released.succeeded

    async def release(
        self,
        hold: Hold,
        holder: Hint[Stored[HolderRecord]] | None = None,
        usage: Hint[Stored[UsageRecord]] | None = None,
        *,
        exact: bool = False,
        tries: int = _RELEASE_TRIES,
    ) -> int:
        """Yield: compare-and-delete the holder key. Moves no data (lazy switching).

        The hold's time goes into the group's usage ledger in the same transaction.
        ``holder`` and ``usage`` save reads: the holder hint only when it is the hold of
        ``hold.epoch``; the compares on both keys' mod revisions keep the delete exact.
        A hold re-stamped since it was read (a re-attach of the call that got the grant) is
        still the holder's to yield: it is read again and released, unless ``exact`` (the
        hold must be as read: a give-back of an undelivered grant loses to a re-attach).
        Returns the store revision of the release.
        """
        k = self.keys
        group, job, epoch = hold.group, hold.job, hold.epoch
        seen = holder.seen if holder is not None else None
        current = seen if seen is not None and hold_epoch(seen) == epoch else None
        if current is None:
            current = await self._holder(group)
        if current is None:
            if await self.etcd.get(k.meta(group)) is None:
                raise NotFound(f"group {group} does not exist")
            raise NotHolder(f"job {job} does not hold group {group} (nobody does)")
        check_hold(hold, current)
        ledger_seen = usage.seen if usage is not None else await self._usage(group)
        ledger = ledger_after(hold, current, ledger_seen)
        result = await self.etcd.txn(
            Txn(
                [
                    modified_at(k.holder(group), current.mod_revision),
                    modified_at(k.usage(group), ledger_seen.mod_revision if ledger_seen else 0),
                ],
                [Delete(k.holder(group)), Put(k.usage(group), ledger.encode())],
                [Get(k.holder(group))],
            ),
            batch=group,
        )
        if result.succeeded:
            return result.revision
        now = result.reads[0]
        ledger_only = bool(now) and now[0].mod_revision == current.mod_revision
        # The same hold, re-stamped since our copy of it (say, a mirror lagging a re-attach).
        restamped = bool(now) and _epoch_of(now[0]) == epoch and not exact
        if ledger_only or restamped:
            if tries <= 1:
                raise Unavailable(f"the hold on {group} kept changing: not released yet")
            # Read afresh what moved (the ledger; the hold too if it was re-stamped).
            again = Hint(current) if ledger_only else None
            return await self.release(hold, again, None, exact=exact, tries=tries - 1)
        raise NotHolder(f"job {job} lost its hold on {group} (session expired?)")

    async def release_undelivered(self, hold: Hold, attempt: str) -> int | None:
        """Give back a grant whose call could not deliver it (the client left as it was
        sent), unless a later attempt of that call has taken it: a client that moved to
        another replica re-attaches to the grant and re-stamps the hold with its attempt.
        Only a hold still stamped with ``attempt`` goes. Returns the release's revision, or
        None when the hold was not this attempt's to give back."""
        current = await self._holder(hold.group)
        if (
            current is None
            or hold_epoch(current) != hold.epoch
            or current.record.attempt != attempt
        ):
            return None
        return await self.release(hold, Hint(current), exact=True)

    async def current_holder(self, group: str) -> Stored[HolderRecord] | None:
        """The group's hold as etcd has it now (not as a mirror saw it)."""
        return await self._holder(group)

    async def group_exists(self, group: str) -> bool:
        return await self.etcd.get(self.keys.meta(group)) is not None

    async def _holder(self, group: str) -> Stored[HolderRecord] | None:
        kv = await self.etcd.get(self.keys.holder(group))
        return Stored.of(kv, HolderRecord.decode(kv.value)) if kv else None

    async def _usage(self, group: str) -> Stored[UsageRecord] | None:
        kv = await self.etcd.get(self.keys.usage(group))
        return Stored.of(kv, UsageRecord.decode(kv.value)) if kv else None


def check_hold(hold: Hold, current: Stored[HolderRecord]) -> None:
    """Raise unless ``current`` is the hold ``hold`` names (its job, epoch and session)."""
    record, group, job = current.record, hold.group, hold.job
    if record.job != job:
        raise PermissionDenied(f"group {group} is held by another job, not {job}")
    epoch = hold_epoch(current)
    if epoch != hold.epoch:
        raise NotHolder(
            f"epoch {hold.epoch} does not match: job {job} holds group {group} under epoch {epoch}"
        )
    if hold.session_id and record.session != hold.session_id:
        raise PermissionDenied(f"the hold on {group} belongs to another session of {job}")


def ledger_after(
    hold: Hold, current: Stored[HolderRecord], seen: Stored[UsageRecord] | None
) -> UsageRecord:
    """The group's usage ledger once ``current`` (the hold being released) has ended."""
    ledger = seen.record.copy() if seen is not None else UsageRecord()
    ledger.add(hold.job, current.record.granted_at, time.time(), current.record.session)
    return ledger


def _epoch_of(kv: KeyValue) -> int:
    """The epoch of a hold read as a bare key-value."""
    return hold_epoch(Stored.of(kv, HolderRecord.decode(kv.value)))
