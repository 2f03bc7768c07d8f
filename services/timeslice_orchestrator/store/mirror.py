"""The mirror's index: every key of the deployment as last seen, indexed by topic, read
through typed accessors (:class:`MirrorIndex`), and the views it hands out (:class:`GroupView`,
:class:`RelayPost`).

Acquire waiters and the switch driver read group state from here and wait on per-topic
conditions instead of each opening its own etcd watch. It is a cache, never an authority:
every decision that changes state is an etcd transaction with compares. What keeps it is the
list-then-watch follower, :class:`~timeslice_orchestrator.store.follower.Mirror`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar

from timeslice_orchestrator.store.etcd import KeyValue
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

# The records decoded once per write (see MirrorIndex._decoded_record).
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
    AgentRecord,
)

__all__ = [
    "AGENTS_TOPIC",
    "RELAY_TOPIC",
    "GroupView",
    "MirrorIndex",
    "RelayPost",
]

AGENTS_TOPIC = Kind.AGENT.value
RELAY_TOPIC = Kind.RELAY.value


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


def _by_key(item: tuple[KeyRef, KeyValue]) -> bytes:
    return item[1].key


def _index(
    topics: dict[str, dict[KeyRef, KeyValue]], groups: set[str], ref: KeyRef, kv: KeyValue
) -> None:
    topics.setdefault(ref.topic, {})[ref] = kv
    if ref.group:
        groups.add(ref.group)


class MirrorIndex:
    """Everything under the keyspace root as last seen, read through typed accessors; kept by
    the follower (:class:`~timeslice_orchestrator.store.follower.Mirror`), which moves
    ``revision`` and stores and drops keys as the watch brings them."""

    def __init__(self, keys: Keyspace) -> None:
        self._keys = keys
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
        # The mod revision of the corrupt features record last logged (0: none).
        self._corrupt_features = 0

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

    def group_creator(self, group: str) -> str | None:
        """``group``'s meta record's job ("": an operator or an older replica; None: none)."""
        kv = self._kv(KeyRef(Kind.META, group))
        try:
            return None if kv is None else GroupMetaRecord.job_of(kv.value)
        except CorruptRecord:
            return None

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
        """The group's statistics as last seen, decoded once per write (not to be changed)."""
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
        """Every node's agent record (decoded once per write: not to be changed), by node."""
        out: dict[str, AgentRecord] = {}
        for ref, kv in sorted(self._topics.get(AGENTS_TOPIC, {}).items(), key=_by_key):
            try:
                out[ref.name] = self._decoded_record(ref, kv, AgentRecord)
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

    def quiet(self, group: str) -> bool:
        """Free and :meth:`idle`: nothing of the group to follow before its next change (most
        groups of a large deployment, at a replica's start). Decodes nothing, as :meth:`idle`."""
        return self._kv(KeyRef(Kind.HOLDER, group)) is None and self.idle(group)

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

    def _replace(
        self,
        topics: dict[str, dict[KeyRef, KeyValue]],
        groups: set[str],
        holders: list[tuple[str, KeyValue]],
        owned: list[tuple[KeyRef, KeyValue]],
        operations: dict[str, str],
    ) -> None:
        """Replace every key at once by those of a complete listing (indexed as it was read)."""
        self._topics, self._groups = topics, groups
        self._operations = operations
        self._decoded = {}
        self._held, self._holder_of = {}, {}
        for held, kv in holders:
            self._hold(held, kv)
        self._owners = OwnerIndex()
        for ref, kv in owned:
            self._owners.stored(ref, self._owner_of(ref, kv))
