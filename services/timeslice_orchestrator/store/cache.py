"""A read-only mirror of the deployment's keys, kept by one list-then-watch loop per replica.

Acquire waiters and the switch driver read group state from here and wait on per-topic
conditions instead of each opening its own etcd watch. It is a cache, never an authority:
every decision that changes state is an etcd transaction with compares.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from timeslice.backoff import Backoff
from timeslice_orchestrator.store.etcd import (
    Compacted,
    EtcdClient,
    EtcdRewound,
    EventType,
    KeyValue,
    MustRelist,
    StoreUnavailable,
    WatchBatch,
)
from timeslice_orchestrator.store.keys import KeyRef, Keyspace, Kind, group_topic
from timeslice_orchestrator.store.owners import OWNED, OwnerIndex
from timeslice_orchestrator.store.records import (
    AgentRecord,
    CorruptRecord,
    FaultRecord,
    FeaturesRecord,
    GroupMetaRecord,
    GroupStats,
    HolderRecord,
    MembersRecord,
    OperationRecord,
    OperationState,
    QueuedJob,
    QueueRecord,
    RelayRecord,
    ResidentRecord,
    SessionRecord,
    Stored,
    SwitchRecord,
    UsageRecord,
    hold_epoch,
)

log = logging.getLogger(__name__)

# The records decoded once per write (see Mirror._decoded_record).
_R = TypeVar(
    "_R",
    SessionRecord,
    HolderRecord,
    ResidentRecord,
    SwitchRecord,
    GroupStats,
    MembersRecord,
    UsageRecord,
    QueueRecord,
    FaultRecord,
    OperationRecord,
    FeaturesRecord,
)

__all__ = [
    "AGENTS_TOPIC",
    "RELAY_TOPIC",
    "GroupView",
    "Mirror",
    "QueuedJob",
    "RelayPost",
    "group_topic",
]

AGENTS_TOPIC = Kind.AGENT.value
RELAY_TOPIC = Kind.RELAY.value
# How far behind its own writes a replica's mirror may be before callers answer UNAVAILABLE.
MIRROR_LAG_TIMEOUT = 10.0
# A watch that brings back none of this replica's own writes for this long is taken for stuck
# and started again, on the next etcd member, from the mirror's revision + 1. (Seen once under
# heavy load: after a member's watch streams failed INTERNAL, the watch resumed on another
# member delivered nothing for over 10 s while that member answered reads.)
WATCH_STUCK_AFTER = 3.0
# A watch that has brought nothing for this long gets a beacon: the mirror writes its beacon key
# and waits for it through the watch, so the rule above also covers a replica with nothing of
# its own to write (one whose driver waits for a release made through another replica). A
# deployment with traffic never writes one; a quiet one writes about one per interval, since
# each replica's beacon is news to the others' watches.
WATCH_QUIET_AFTER = 5.0
_STUCK_CHECK_EVERY = 0.5


@dataclass(slots=True)
class GroupView:
    """A consistent snapshot of one group's keys at ``revision``."""

    group: str
    revision: int
    exists: bool
    holder: Stored[HolderRecord] | None
    queue: list[QueuedJob]  # FIFO: ordered by create revision
    resident: Stored[ResidentRecord] | None
    switch: Stored[SwitchRecord] | None
    driver: str | None
    driver_lease: int
    faults: dict[str, Stored[FaultRecord]] = field(default_factory=dict)
    stats: GroupStats = field(default_factory=GroupStats)
    static_members: list[str] = field(default_factory=list)
    usage: Stored[UsageRecord] | None = None
    stats_revision: int = 0  # mod revisions of the stats and members keys (0: absent)
    members_revision: int = 0
    # Operator operations (snapshot / restore) by id, oldest request first.
    operations: dict[str, Stored[OperationRecord]] = field(default_factory=dict)

    def pending_operation(self) -> Stored[OperationRecord] | None:
        """The oldest operation not begun yet (the driver runs them one at a time, in order)."""
        return next(
            (o for o in self.operations.values() if o.record.state is OperationState.PENDING),
            None,
        )

    def queued(self, job: str) -> QueuedJob | None:
        return next((q for q in self.queue if q.job == job), None)

    def position(self, job: str) -> int | None:
        return next((i for i, q in enumerate(self.queue) if q.job == job), None)

    def residency(self) -> ResidentRecord:
        """A copy of the residency record to edit (empty when there is none)."""
        if self.resident is None:
            return ResidentRecord()
        record = self.resident.record
        return ResidentRecord(
            {node: list(jobs) for node, jobs in record.nodes.items()},
            {node: list(jobs) for node, jobs in record.parked.items()},
        )

    @property
    def resident_revision(self) -> int:
        return self.resident.mod_revision if self.resident else 0


@dataclass(frozen=True, slots=True)
class RelayPost:
    """A directive posted for ``node``'s agent (and, once answered, its ack)."""

    node: str
    directive_id: str
    posted: Stored[RelayRecord]


# Keys indexed between two looks at the event loop while listing.
_YIELD_EVERY = 4096


def _by_key(item: tuple[KeyRef, KeyValue]) -> bytes:
    return item[1].key


def _index(
    topics: dict[str, dict[KeyRef, KeyValue]], groups: set[str], ref: KeyRef, kv: KeyValue
) -> None:
    topics.setdefault(ref.topic, {})[ref] = kv
    if ref.group:
        groups.add(ref.group)


class Mirror:
    """List-watch mirror of everything under the keyspace root, read through typed accessors."""

    def __init__(self, etcd: EtcdClient, keys: Keyspace, *, name: str = "mirror") -> None:
        self._etcd = etcd
        self._keys = keys
        self._name = name  # written in the beacon key, to tell whose it was
        # Keys indexed by topic (one group, the sessions, the agents, the relay), so reading
        # one group costs its own few keys.
        self._topics: dict[str, dict[KeyRef, KeyValue]] = {}
        # Records decoded once per write (a group is read several times per change):
        # by key, the mod revision decoded and the record. Callers must not change them.
        self._decoded: dict[KeyRef, tuple[int, Any]] = {}
        self._groups: set[str] = set()
        # Who holds what, by session and by group, so a session's keepalive finds the groups
        # it holds without looking at every group of the deployment.
        self._held: dict[str, set[str]] = {}
        self._holder_of: dict[str, str] = {}
        # Who owns which session, queue entry and hold, counted for the quotas.
        self._owners = OwnerIndex()
        # Operator operations: id -> group, so GetOperation finds one by its id alone.
        self._operations: dict[str, str] = {}
        self.revision = 0
        self.synced = asyncio.Event()
        # Callers of wait_for_change, by topic (none kept for a topic nobody waits for).
        self._change_waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._listeners: list[Callable[[set[str]], None]] = []
        self.listener_errors = 0
        """Listener calls that raised (each logged); the mirror went on."""
        self._versions: dict[str, int] = {}
        self._revision_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        # Since when (time.monotonic()) the mirror has been behind a write it was told of and
        # has not moved towards it; None when it is not behind.
        self._behind_since: float | None = None
        # When (time.monotonic()) the watch last brought something, or a beacon was written.
        self._heard_at = time.monotonic()
        # The mod revision of the corrupt features record last logged (0: none).
        self._corrupt_features = 0
        self._seq = 0
        self.reconnects = 0
        self.rewinds = 0
        """Times etcd was found behind the mirror (it lost acknowledged writes): re-listed."""
        # Set by a beacon write that came back at or below the mirror's revision.
        self._rewound: EtcdRewound | None = None
        # The newest write the watch brought: a resumed watch checks etcd still has it.
        self._last_put: KeyValue | None = None

    # -- reading ------------------------------------------------------------------------

    def _kv(self, ref: KeyRef) -> KeyValue | None:
        return self._topics.get(ref.topic, {}).get(ref)

    def group_names(self) -> list[str]:
        return sorted(self._groups)

    # -- counts for the quotas (each O(1): a flood must not slow other calls) -------------

    def group_count(self) -> int:
        return len(self._groups)

    def has_group(self, group: str) -> bool:
        return group in self._groups

    def session_count(self) -> int:
        return len(self._topics.get(Kind.SESSION.value, {}))

    def sessions_of(self, job: str) -> int:
        """Live sessions of ``job``."""
        return self._owners.sessions_per_job.get(job, 0)

    def entries_of(self, session_id: str) -> int:
        """Queue entries and holds of the session, over every group."""
        return self._owners.entries_per_session.get(session_id, 0)

    def groups_of(self, job: str) -> int:
        """Groups whose first Acquire was ``job``'s, until the idle clean-up removes them."""
        return self._owners.groups_per_job.get(job, 0)

    def group_revision(self, group: str) -> int:
        """The newest mod revision among the group's keys (0: no keys)."""
        keys = self._topics.get(group_topic(group), {})
        return max((kv.mod_revision for kv in keys.values()), default=0)

    def session(self, session_id: str) -> Stored[SessionRecord] | None:
        ref = KeyRef(Kind.SESSION, name=session_id)
        kv = self._kv(ref)
        return Stored.of(kv, self._decoded_record(ref, kv, SessionRecord)) if kv else None

    def holder(self, group: str) -> Stored[HolderRecord] | None:
        """The group's hold as last seen (None: free, or no such group)."""
        ref = KeyRef(Kind.HOLDER, group)
        kv = self._kv(ref)
        return Stored.of(kv, self._decoded_record(ref, kv, HolderRecord)) if kv else None

    def hold_epoch(self, group: str) -> int:
        """The epoch of the group's hold (:func:`hold_epoch`); 0 when free. It runs on every
        change of every group, so a hold its grant wrote and nothing rewrote (the usual one)
        is not decoded: its epoch is its create revision."""
        ref = KeyRef(Kind.HOLDER, group)
        kv = self._kv(ref)
        if kv is None:
            return 0
        if kv.mod_revision == kv.create_revision:
            return kv.create_revision
        try:
            return hold_epoch(Stored.of(kv, self._decoded_record(ref, kv, HolderRecord)))
        except CorruptRecord:
            return kv.create_revision

    def features(self) -> Stored[FeaturesRecord] | None:
        """The deployment's feature record as last seen (None: none written, or corrupt)."""
        ref = KeyRef(Kind.FEATURES)
        kv = self._kv(ref)
        if kv is None:
            return None
        try:
            return Stored.of(kv, self._decoded_record(ref, kv, FeaturesRecord))
        except CorruptRecord:
            if self._corrupt_features != kv.mod_revision:  # once per write, not per yield
                self._corrupt_features = kv.mod_revision
                log.exception("ignoring a corrupt features record: all off until rewritten")
            return None

    def stats(self, group: str) -> GroupStats | None:
        """The group's statistics as last seen, decoded once per write (callers must not
        change the record; a whole :meth:`group` view hands out a copy)."""
        ref = KeyRef(Kind.STATS, group)
        kv = self._kv(ref)
        return self._decoded_record(ref, kv, GroupStats) if kv else None

    def switch(self, group: str) -> Stored[SwitchRecord] | None:
        """The group's switch record as last seen (None: no switch in flight)."""
        ref = KeyRef(Kind.SWITCH, group)
        kv = self._kv(ref)
        return Stored.of(kv, self._decoded_record(ref, kv, SwitchRecord)) if kv else None

    def usage(self, group: str) -> Stored[UsageRecord] | None:
        """The group's usage ledger as last seen (None: nothing was ever released)."""
        ref = KeyRef(Kind.USAGE, group)
        kv = self._kv(ref)
        return Stored.of(kv, self._decoded_record(ref, kv, UsageRecord)) if kv else None

    def has_waiters(self, group: str) -> bool:
        """Whether anyone was last seen waiting for ``group`` (cheaper than a whole view)."""
        return any(ref.kind is Kind.QUEUE for ref in self._topics.get(group_topic(group), {}))

    def mentions(self, group: str, needle: bytes) -> bool:
        """Whether a key or a value of ``group`` contains ``needle``, nothing decoded: a cheap
        test that a job (ids are plain ASCII, stored as is) has no record in the group."""
        return any(
            needle in kv.key or needle in kv.value
            for kv in self._topics.get(group_topic(group), {}).values()
        )

    def groups_resident_on(self, node: str) -> list[str]:
        """Groups whose residency lists ``node`` (cheap: most records are not even decoded)."""
        out = []
        needle = node.encode()
        for group in sorted(self._groups):
            kv = self._kv(KeyRef(Kind.RESIDENT, group))
            if kv is None or needle not in kv.value:
                continue
            try:
                if node in ResidentRecord.decode(kv.value).nodes:
                    out.append(group)
            except CorruptRecord:
                log.exception("ignoring corrupt residency of %s", group)
        return out

    def agents(self) -> dict[str, AgentRecord]:
        """Every node's agent record, by node; corrupt records are logged and left out."""
        out: dict[str, AgentRecord] = {}
        for ref, kv in sorted(self._topics.get(AGENTS_TOPIC, {}).items(), key=_by_key):
            try:
                out[ref.name] = AgentRecord.decode(kv.value)
            except CorruptRecord:
                log.exception("ignoring corrupt agent record of %s", ref.name)
        return out

    def relay(self, node: str, directive_id: str) -> Stored[RelayRecord] | None:
        """The relay key of one directive: posted, answered (``ack`` set), or gone (None)."""
        kv = self._kv(KeyRef(Kind.RELAY, name=node, directive=directive_id))
        return Stored.of(kv, RelayRecord.decode(kv.value)) if kv else None

    def relays(self) -> list[RelayPost]:
        """Every relayed directive; corrupt records are logged and left out."""
        out: list[RelayPost] = []
        for ref, kv in sorted(self._topics.get(RELAY_TOPIC, {}).items(), key=_by_key):
            try:
                posted = Stored.of(kv, RelayRecord.decode(kv.value))
            except CorruptRecord:
                log.exception("ignoring corrupt relay record %s/%s", ref.name, ref.directive)
                continue
            out.append(RelayPost(ref.name, ref.directive, posted))
        return out

    def operation(self, operation_id: str) -> Stored[OperationRecord] | None:
        """An operator operation by id, wherever its group; None when unknown or expired."""
        group = self._operations.get(operation_id)
        if group is None:
            return None
        ref = KeyRef(Kind.OPERATION, group, operation_id)
        kv = self._kv(ref)
        if kv is None:
            return None
        try:
            return Stored.of(kv, self._decoded_record(ref, kv, OperationRecord))
        except CorruptRecord:
            log.exception("ignoring corrupt operation record %s/%s", group, operation_id)
            return None

    def _pending(self, ref: KeyRef, kv: KeyValue) -> bool:
        """Whether an operation key is one the driver has still to begin (decoded once per
        write; only groups with operations pay for it)."""
        try:
            record = self._decoded_record(ref, kv, OperationRecord)
        except CorruptRecord:
            return False
        return record.state is OperationState.PENDING

    def held_by(self, session_id: str) -> list[str]:
        """The groups whose hold belongs to the session, as last seen."""
        return sorted(self._held.get(session_id, ()))

    def idle(self, group: str) -> bool:
        """No switch record, nobody queued and no pending operation. Decodes nothing but
        operation records, so looking at every group of a large deployment (at start, on a
        re-list) is cheap."""
        for ref, kv in self._topics.get(group_topic(group), {}).items():
            if ref.kind is Kind.QUEUE or ref.kind is Kind.SWITCH:
                return False
            if ref.kind is Kind.OPERATION and self._pending(ref, kv):
                return False
        return True

    def needs_driver(self, group: str) -> bool:
        """A switch record, a waiter, a pending operator operation, or a residency written
        after the hold began: the last is a node that came back (after a fence, a lost lease)
        and may lack the holder's state. A grant writes the hold, and the residency when it
        changes, in one transaction, so on the hot path the residency is never newer than the
        hold. Decodes nothing but operation records, like :meth:`idle`."""
        hold = resident = 0
        for ref, kv in self._topics.get(group_topic(group), {}).items():
            kind = ref.kind
            if kind is Kind.QUEUE or kind is Kind.SWITCH:
                return True
            if kind is Kind.OPERATION and self._pending(ref, kv):
                return True
            if kind is Kind.HOLDER:
                hold = kv.mod_revision
            elif kind is Kind.RESIDENT:
                resident = kv.mod_revision
        return 0 < hold < resident

    def summary(self, group: str) -> tuple[HolderRecord | None, int, bool]:
        """The group's hold, how many wait, and whether it switches: what a listing of every
        group shows, read without decoding the group's other records."""
        holder: HolderRecord | None = None
        queued = 0
        switching = False
        for ref, kv in self._topics.get(group_topic(group), {}).items():
            if ref.kind is Kind.HOLDER:
                holder = HolderRecord.decode(kv.value)
            elif ref.kind is Kind.QUEUE:
                queued += 1
            elif ref.kind is Kind.SWITCH:
                switching = True
        return holder, queued, switching

    def group(self, group: str) -> GroupView:
        holder = resident = switch = None
        driver: str | None = None
        driver_lease = 0
        queue: list[QueuedJob] = []
        faults: dict[str, Stored[FaultRecord]] = {}
        operations: list[Stored[OperationRecord]] = []
        stats = GroupStats()
        members: list[str] = []
        usage: Stored[UsageRecord] | None = None
        stats_revision = members_revision = 0
        keys = self._topics.get(group_topic(group), {})
        decoded = self._decoded_record
        for ref, kv in keys.items():
            match ref.kind:
                case Kind.HOLDER:
                    holder = Stored.of(kv, decoded(ref, kv, HolderRecord))
                case Kind.RESIDENT:
                    resident = Stored.of(kv, decoded(ref, kv, ResidentRecord))
                case Kind.SWITCH:
                    switch = Stored.of(kv, decoded(ref, kv, SwitchRecord))
                case Kind.DRIVER:
                    driver, driver_lease = kv.value.decode(), kv.lease
                case Kind.STATS:
                    # A copy: callers count on it and write it back.
                    stats = dataclasses.replace(decoded(ref, kv, GroupStats))
                    stats_revision = kv.mod_revision
                case Kind.MEMBERS:
                    members = list(decoded(ref, kv, MembersRecord).nodes)
                    members_revision = kv.mod_revision
                case Kind.USAGE:
                    usage = Stored.of(kv, decoded(ref, kv, UsageRecord))
                case Kind.QUEUE:
                    entry = Stored.of(kv, decoded(ref, kv, QueueRecord))
                    queue.append(QueuedJob(ref.name, entry))
                case Kind.FAULT:
                    faults[ref.name] = Stored.of(kv, decoded(ref, kv, FaultRecord))
                case Kind.OPERATION:
                    operations.append(Stored.of(kv, decoded(ref, kv, OperationRecord)))
        queue.sort(key=lambda q: q.revision)
        operations.sort(key=lambda o: o.create_revision)
        return GroupView(
            group,
            self.revision,
            bool(keys),
            holder,
            queue,
            resident,
            switch,
            driver,
            driver_lease,
            dict(sorted(faults.items())),
            stats,
            members,
            usage,
            stats_revision,
            members_revision,
            {o.record.operation_id: o for o in operations},
        )

    def _decoded_record(self, ref: KeyRef, kv: KeyValue, kind: type[_R]) -> _R:
        seen = self._decoded.get(ref)
        if seen is not None and seen[0] == kv.mod_revision:
            record: _R = seen[1]
            return record
        record = kind.decode(kv.value)
        self._decoded[ref] = (kv.mod_revision, record)
        return record

    def _store(self, ref: KeyRef, kv: KeyValue) -> None:
        _index(self._topics, self._groups, ref, kv)
        if ref.kind in OWNED:
            self._owners.stored(ref, self._owner_of(ref, kv))
        if ref.kind is Kind.HOLDER:
            self._hold(ref.group, kv)
        elif ref.kind is Kind.OPERATION:
            self._operations[ref.name] = ref.group

    def _drop(self, ref: KeyRef) -> None:
        if ref.kind is Kind.HOLDER:
            self._unhold(ref.group)
        elif ref.kind is Kind.OPERATION and self._operations.get(ref.name) == ref.group:
            del self._operations[ref.name]
        keys = self._topics.get(ref.topic)
        if keys is None:
            return
        keys.pop(ref, None)
        self._decoded.pop(ref, None)
        self._owners.dropped(ref)
        if not keys:
            del self._topics[ref.topic]
            self._groups.discard(ref.group)

    def _owner_of(self, ref: KeyRef, kv: KeyValue) -> str | None:
        """A session's job, or an entry's or a hold's session (decoded once per write, like
        every record the mirror hands out), or the job that created a group (its meta key);
        None when the record does not decode."""
        try:
            if ref.kind is Kind.META:
                # Not kept decoded: nothing else reads it, and there is one per group.
                return GroupMetaRecord.job_of(kv.value) or None
            if ref.kind is Kind.SESSION:
                return self._decoded_record(ref, kv, SessionRecord).job
            if ref.kind is Kind.QUEUE:
                return self._decoded_record(ref, kv, QueueRecord).session
            return self._decoded_record(ref, kv, HolderRecord).session
        except CorruptRecord:
            log.exception("ignoring corrupt record %s", kv.key.decode(errors="replace"))
            return None

    def _hold(self, group: str, kv: KeyValue) -> None:
        self._unhold(group)
        session = self._owner_of(KeyRef(Kind.HOLDER, group), kv)
        if session is None:
            return
        self._holder_of[group] = session
        self._held.setdefault(session, set()).add(group)

    def _unhold(self, group: str) -> None:
        session = self._holder_of.pop(group, None)
        if session is None:
            return
        groups = self._held[session]
        groups.discard(group)
        if not groups:
            del self._held[session]

    # -- waiting ------------------------------------------------------------------------

    def version(self, topic: str) -> int:
        """Moves with every change seen on ``topic`` (0: none kept); read it before looking,
        then :meth:`wait_for_change` from it, so that no change is missed in between.

        Versions come from one counter for all topics, so a topic forgotten (every key of it
        gone) and seen again never repeats a version a waiter may hold."""
        return self._versions.get(topic, 0)

    @property
    def tracked_topics(self) -> int:
        """Topics with a version or a waiter kept (diagnostics: it follows the keys, not
        every group name ever seen)."""
        return len(self._versions.keys() | self._change_waiters.keys())

    async def wait_for_change(self, topic: str, seen: int) -> None:
        """Until :meth:`version` of ``topic`` is no longer ``seen``."""
        loop = asyncio.get_running_loop()
        while self._versions.get(topic, 0) == seen:
            changed = loop.create_future()
            waiters = self._change_waiters.setdefault(topic, set())
            waiters.add(changed)
            try:
                await changed
            finally:
                waiters.discard(changed)
                if not waiters and self._change_waiters.get(topic) is waiters:
                    del self._change_waiters[topic]

    def add_listener(self, listener: Callable[[set[str]], None]) -> None:
        """Call ``listener(topics)`` after every applied batch of changes."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[set[str]], None]) -> None:
        """Stop calling ``listener`` (a driver or router of a replica term that ended)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    async def wait_for_revision(self, revision: int, timeout: float) -> None:
        """Wait until the mirror reflects ``revision`` (one of our own writes)."""
        if self.revision >= revision:
            return
        # A heap of futures, resolved in revision order as batches land: no waiter is woken
        # by changes that do not concern it.
        waiter = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._revision_waiters, (revision, self._seq, waiter))
        if self._behind_since is None:
            self._behind_since = time.monotonic()
        reached = False
        try:
            async with asyncio.timeout(timeout):
                await waiter
            reached = True
        except TimeoutError as exc:
            # Typed, so callers answer UNAVAILABLE (clients retry elsewhere), never a bare 500.
            raise StoreUnavailable(
                f"this replica's view of etcd is more than {timeout:g} s behind "
                f"(at revision {self.revision}, waiting for {revision})"
            ) from exc
        finally:
            if not reached:
                # Given up on (timed out, or its caller cancelled): it no longer counts as
                # the mirror being behind.
                waiter.cancel()
                self._revision_waiters = [w for w in self._revision_waiters if not w[2].done()]
                heapq.heapify(self._revision_waiters)
                if not self._revision_waiters:
                    self._behind_since = None

    async def catch_up(self, timeout: float) -> None:
        """Write the beacon key and wait until the watch brings it back: the mirror then holds
        everything etcd held before it. (etcd's revision alone can move by writes under other
        prefixes, which no event here shows.) Raises StoreUnavailable if etcd does not take
        the write, or the watch does not bring it back within ``timeout``."""
        # Read before the write: the watch may bring the write back before its answer.
        seen = self.revision
        written = await self._etcd.put(self._keys.beacon(), self._name.encode())
        if written <= seen:
            # A new write not past what the mirror had seen before it: etcd lost writes (its
            # revisions are being used again), which no watch reports. _watch re-lists.
            self._rewound = EtcdRewound(
                f"etcd wrote the beacon at revision {written}, not past revision {seen} that "
                f"this replica had seen: it lost writes it had acknowledged"
            )
            raise StoreUnavailable(str(self._rewound))
        await self.wait_for_revision(written, timeout)

    def _release_revision_waiters(self) -> None:
        released = False
        while self._revision_waiters and self._revision_waiters[0][0] <= self.revision:
            _, _, waiter = heapq.heappop(self._revision_waiters)
            released = True
            if not waiter.done():
                waiter.set_result(None)
        if not self._revision_waiters:
            self._behind_since = None
        elif released:
            self._behind_since = time.monotonic()  # moving: the watch is not stuck

    # -- maintaining --------------------------------------------------------------------

    async def run(self) -> None:
        """List, then watch from the next revision; re-list on compaction, resume on errors.

        A watch resumed after an error first checks that etcd is not behind the mirror: a
        watch from a revision etcd has not reached (it lost writes) waits silently for new
        ones and would skip those that reuse the lost revisions."""
        backoff = Backoff(jitter=False)
        resuming = False
        while True:
            try:
                if not self.synced.is_set():
                    await self._relist()
                elif resuming:
                    await self._check_not_rewound()
                resuming = False
                await self._watch(backoff)
            except EtcdRewound as exc:
                self.rewinds += 1
                log.error("%s; re-listing", exc)
                self._fail_revision_waiters(exc)
                self.synced.clear()
            except MustRelist as exc:
                # The watch's start, or the revision a paged list was being read at, is gone,
                # or a watch response did not fit: list afresh and watch on from there.
                log.warning("%s; re-listing", exc)
                self.synced.clear()
            except StoreUnavailable as exc:
                self.reconnects += 1
                resuming = True
                log.warning("etcd watch interrupted (%s); resuming from %d", exc, self.revision + 1)
                await asyncio.sleep(backoff.next_delay())

    async def _check_not_rewound(self) -> None:
        """Raise EtcdRewound if etcd lost writes this mirror has seen: its revision is behind
        the mirror's, or (new writes may have taken it past since) the newest write the
        watch brought is not what etcd has at that revision."""
        current = await self._etcd.revision(self._keys.root)
        if current < self.revision:
            raise EtcdRewound(
                f"etcd is at revision {current}, behind revision {self.revision} that this "
                f"replica has seen: it lost writes it had acknowledged"
            )
        last = self._last_put
        if last is None:
            return
        try:
            there = await self._etcd.get(last.key, revision=last.mod_revision)
        except Compacted:
            return  # that history is gone: the resumed watch is told so, and re-lists
        if there != last:
            raise EtcdRewound(
                f"etcd's revision {last.mod_revision} is not the write of {last.key!r} this "
                f"replica saw there: it lost writes it had acknowledged"
            )

    def _fail_revision_waiters(self, rewound: EtcdRewound) -> None:
        """Callers waiting for their writes to show: those writes may be among the lost, and
        new writes will reuse their revisions. They answer UNAVAILABLE; clients retry."""
        waiters, self._revision_waiters = self._revision_waiters, []
        self._behind_since = None
        for _, _, waiter in waiters:
            if not waiter.done():
                waiter.set_exception(StoreUnavailable(str(rewound)))

    async def _watch(self, backoff: Backoff) -> None:
        """Apply the watch's batches until it fails, or until it looks stuck (it brought back
        none of this replica's writes for :data:`WATCH_STUCK_AFTER`): then its member is
        passed over and StoreUnavailable makes :meth:`run` resume it. A quiet watch gets a
        beacon (:meth:`_beacon_when_quiet`), so it always has a write of ours to bring back."""
        follow = asyncio.ensure_future(self._follow(backoff))
        beacon = asyncio.ensure_future(self._beacon_when_quiet())
        try:
            while not follow.done():
                await asyncio.wait(
                    {follow, beacon},
                    timeout=_STUCK_CHECK_EVERY,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if beacon.done():
                    beacon.result()  # it only ends by a bug: let the supervisor see it
                if self._rewound is not None:
                    raise self._rewound
                behind = self._behind_since
                if follow.done() or behind is None:
                    continue
                if time.monotonic() - behind < WATCH_STUCK_AFTER:
                    continue
                self._behind_since = time.monotonic()  # the next watch gets its own time
                reason = (
                    f"the watch brought back none of this replica's writes for "
                    f"{WATCH_STUCK_AFTER:g} s (at revision {self.revision})"
                )
                self._etcd.pass_over_watch_member(reason)
                follow.cancel()
                await asyncio.wait({follow})
                raise StoreUnavailable(f"{reason}: starting it again")
            follow.result()
        finally:
            follow.cancel()
            beacon.cancel()
            await asyncio.wait({follow, beacon})

    async def _beacon_when_quiet(self) -> None:
        """Each time the watch has brought nothing for :data:`WATCH_QUIET_AFTER`, write the
        beacon and wait for it: a stuck watch then trips the rule of :meth:`_watch`."""
        while True:
            quiet_for = time.monotonic() - self._heard_at
            if quiet_for < WATCH_QUIET_AFTER:
                await asyncio.sleep(WATCH_QUIET_AFTER - quiet_for)
                continue
            self._heard_at = time.monotonic()  # one beacon per quiet interval
            try:
                await self.catch_up(MIRROR_LAG_TIMEOUT)
            except StoreUnavailable as exc:
                # etcd is down (the watch fails too and resumes on its own), or the watch is
                # stuck and _watch has already passed its member over.
                log.debug("watch beacon not seen: %s", exc)

    async def _follow(self, backoff: Backoff) -> None:
        async for batch in self._etcd.watch_prefix(self._keys.root, self.revision + 1):
            backoff.reset()
            await self._apply(batch)

    async def _relist(self) -> None:
        """Read every key, page by page at one revision, then replace the mirror at once.

        Readers keep the previous snapshot (or none, before the first sync) until the last
        page is in: a half-read listing is never visible. Pages are indexed as they arrive, so
        at most two pages of etcd's messages (this one and the next, read ahead) are held.
        """
        topics: dict[str, dict[KeyRef, KeyValue]] = {}
        groups: set[str] = set()
        revision = 0
        parse = self._keys.parse
        # Keys come in key order, so a group's keys come together: look its topic up once.
        group, keys = "", {}
        holders: list[tuple[str, KeyValue]] = []
        owned: list[tuple[KeyRef, KeyValue]] = []  # sessions, entries and holds: the quotas
        operations: dict[str, str] = {}
        async with contextlib.aclosing(self._etcd.pages(self._keys.root)) as pages:
            async for at, page in pages:
                revision = at
                for n, kv in enumerate(page, 1):
                    if n % _YIELD_EVERY == 0:
                        # A page is tens of thousands of keys: let the rest of the replica
                        # (its lease keepalive first) run between slices of it.
                        await asyncio.sleep(0)
                    ref = parse(kv.key)
                    if ref is None:
                        continue
                    if ref.kind is Kind.HOLDER:
                        holders.append((ref.group, kv))
                    if ref.kind in OWNED:
                        owned.append((ref, kv))
                    elif ref.kind is Kind.OPERATION:
                        operations[ref.name] = ref.group
                    if not ref.group or ref.group != group:
                        keys = topics.setdefault(ref.topic, {})
                        group = ref.group
                        if group:
                            groups.add(group)
                    keys[ref] = kv
        old = set(self._topics)
        self._topics, self._groups = topics, groups
        self._operations = operations
        self._decoded = {}
        self._held, self._holder_of = {}, {}
        for held, kv in holders:
            self._hold(held, kv)
        self._owners = OwnerIndex()
        for ref, kv in owned:
            self._owners.stored(ref, self._owner_of(ref, kv))
        self.revision = revision
        self._last_put = None
        self._rewound = None  # whatever a beacon found is covered by this listing
        self._heard_at = time.monotonic()
        self.synced.set()
        await self._notify(old | set(topics))

    async def _apply(self, batch: WatchBatch) -> None:
        if batch.events:  # an empty batch (etcd's progress notification) is no news
            self._heard_at = time.monotonic()
        topics: set[str] = set()
        for ev in batch.events:
            ref = self._keys.parse(ev.kv.key)
            if ref is None:
                continue  # not a key of the layout: nothing reads it
            if ev.type is EventType.PUT:
                self._store(ref, ev.kv)
                self._last_put = ev.kv
            else:
                self._drop(ref)
            topics.add(ref.topic)
        # A batch's header revision can run ahead of its events while a watcher catches up,
        # so only an empty batch (a progress notification) may move the revision past them.
        newest = max((ev.kv.mod_revision for ev in batch.events), default=batch.revision)
        if newest > self.revision:
            self.revision = newest
        await self._notify(topics)

    async def _notify(self, topics: set[str]) -> None:
        self._release_revision_waiters()
        for topic in (*topics, "*"):
            self._seq += 1
            if topic == "*" or topic in self._topics:
                self._versions[topic] = self._seq
            else:
                # Every key of it is gone: a version kept for it would be kept for good.
                self._versions.pop(topic, None)
            for changed in self._change_waiters.pop(topic, ()):
                if not changed.done():
                    changed.set_result(None)
        for listener in self._listeners:
            try:
                listener(topics)
            except Exception:
                # An observer's bug (a record it cannot decode) must not stop the mirror that
                # every call of this replica reads, nor keep the change from the others.
                self.listener_errors += 1
                log.exception("mirror listener %r failed on %s", listener, sorted(topics))
