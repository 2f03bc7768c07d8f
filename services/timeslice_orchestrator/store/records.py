"""Typed values stored in etcd, encoded as compact JSON.

A record that fails to decode is a bug or a foreign writer; decoding raises CorruptRecord
rather than guessing.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any, Generic, Self, TypeVar

from timeslice_orchestrator.store.etcd import KeyValue


class CorruptRecord(ValueError):
    pass


class _Record:
    def encode(self) -> bytes:
        # json calls _plain for each dataclass and enum it meets: the same JSON as
        # dataclasses.asdict, without its deep copy of every value (the hot path encodes a
        # few records per acquire).
        return _ENCODER.encode(self).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Self:
        try:
            data = json.loads(raw)
            return cls._from_dict(data)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:  # (JSON not an object)
            raise CorruptRecord(f"{cls.__name__}: {exc}: {raw[:200]!r}") from exc

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        return cls(**_known(cls, data))


def _known(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` without the keys ``cls`` has no field for. Every record, and every value
    nested in one, is read through this: fields a newer version added are left out, since
    replicas of two versions share etcd during a rolling upgrade."""
    known = _FIELD_NAMES.get(cls)
    if known is None:
        known = _FIELD_NAMES[cls] = frozenset(f.name for f in dataclasses.fields(cls))
    return {k: v for k, v in data.items() if k in known}


def _plain(obj: object) -> object:
    """What json writes for a record (its fields, in order) or an enum (its value)."""
    names = _FIELDS.get(type(obj))
    if names is None:
        if isinstance(obj, enum.Enum):
            return obj.value
        if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
            raise TypeError(f"not serialisable: {obj!r}")
        names = _FIELDS[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    return {name: getattr(obj, name) for name in names}


# GroupMetaRecord as this version encodes it (a job id has no quote or backslash to escape).
_META_JOB = re.compile(rb'\{"job":"([^"\\]*)"\}')
_FIELDS: dict[type, tuple[str, ...]] = {}
_FIELD_NAMES: dict[type, frozenset[str]] = {}
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_plain)


@dataclass(slots=True)
class SessionRecord(_Record):
    job: str
    host: str
    pid: int
    opened_at: float
    # SHA-256 (hex) of the session's secret: never the secret itself, so reading etcd is not
    # enough to act on a session. "" (a record from before secrets): nothing matches it.
    secret_hash: str = ""


@dataclass(slots=True)
class GroupMetaRecord(_Record):
    """A group's ``meta`` key: the group exists, and whose quota it counts against."""

    # The job whose Acquire created the group (an operator acting as a job: that job). Its
    # groups count against ``--max-groups-per-job`` until the idle clean-up removes them. ""
    # for a group created by an operator's SetGroupMembers, or by a replica older than this
    # field: counted in ``--max-groups`` only.
    job: str = ""

    @classmethod
    def job_of(cls, raw: bytes) -> str:
        """The ``job`` of an encoded record: what the mirror reads of every group's meta key
        when it lists (100,000 of them), so the shape this version writes is matched without
        a JSON decode; any other (an older or newer writer's) is decoded."""
        if raw in (b"", b"{}"):
            return ""  # no creator: an operator's group, or an older replica's
        plain = _META_JOB.fullmatch(raw)
        return plain.group(1).decode() if plain else cls.decode(raw).job


@dataclass(slots=True)
class QueueRecord(_Record):
    session: str
    priority: int
    enqueued_at: float
    request_id: str = ""
    attempt: str = ""
    # The W3C trace context of the Acquire that queued (its server span): the switch that
    # serves this waiter, driven by any replica, links to it. Empty when tracing is off.
    trace_context: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class HolderRecord(_Record):
    job: str
    session: str
    granted_at: float
    waited_seconds: float = 0.0
    restored: bool = False
    previous_job: str = ""
    switch_seconds: float = 0.0
    request_id: str = ""
    attempt: str = ""
    # The create revision of the queue entry this grant served: the waiter's place in line.
    # Kept so a client that re-attaches to its grant (after a replica died mid-delivery)
    # learns the same ticket as if the grant had reached it the first time.
    ticket: int = 0
    # Written by a hand-over in one transaction (the previous hold overwritten, not deleted:
    # the key keeps its create revision), whose epoch is the revision of that write. A later
    # rewrite of such a hold (a re-attach) keeps its epoch in ``epoch``. See :func:`hold_epoch`.
    handed_over: bool = False
    epoch: int = 0


@dataclass(slots=True)
class FeaturesRecord(_Record):
    """What the deployment's replicas may do that older replicas would misread
    (``features``; docs/operations.md, "Upgrades"). A replica reads it, never assumes it."""

    # Yield hands the group to the next waiter in the release's own transaction (the holder
    # key overwritten): an older replica would take the new hold's epoch for the old one's.
    one_transaction_hand_over: bool = False

    def switches(self) -> dict[str, bool]:
        """Each feature by name, and whether it is on."""
        return {f.name: bool(getattr(self, f.name)) for f in dataclasses.fields(self)}


@dataclass(slots=True)
class ResidentRecord(_Record):
    """Whose device state is on the devices of each node of the group, and whose is parked.

    Per node, the jobs whose state is on the devices, least recently restored first: the last
    one is the job that ran last there. Several jobs share a node's devices when its backend
    reports the capacity for them (co-residency), else there is at most one.

    ``parked``: per node, the jobs whose state a checkpoint took off that node's devices (for
    the freeze backend: their processes there are stopped) and that no restore has brought
    back, as the group's switches committed it or the node's agent reported it. Such a job is
    not whole without that node; it is not granted while the node cannot restore it
    (:func:`timeslice_orchestrator.switch_plan.stranded`). A job is never both on a node's
    devices and parked there: :meth:`encode` drops it from ``parked``.
    """

    nodes: dict[str, list[str]] = field(default_factory=dict)
    parked: dict[str, list[str]] = field(default_factory=dict)

    def remove(self, node: str, job: str) -> None:
        """``job``'s state is no longer on ``node``'s devices (where it went is not said)."""
        _drop(self.nodes, node, job)

    def place(self, node: str, job: str) -> None:
        """``job`` is now the most recently restored job on ``node``."""
        jobs = [j for j in self.nodes.get(node, []) if j != job]
        self.nodes[node] = [*jobs, job]
        _drop(self.parked, node, job)

    def park(self, node: str, job: str) -> None:
        """``job``'s state was checkpointed off ``node``'s devices and stays on that node."""
        _drop(self.nodes, node, job)
        if job not in self.parked.get(node, []):
            self.parked[node] = [*self.parked.get(node, []), job]

    def forget(self, node: str, job: str) -> None:
        """Nothing of ``job`` is on ``node`` any more (its workers there left)."""
        _drop(self.nodes, node, job)
        _drop(self.parked, node, job)

    def encode(self) -> bytes:
        # Whatever put a job on a node's devices (a hello's report, a grant) settles that it
        # is not parked there.
        for node, jobs in list(self.parked.items()):
            kept = [j for j in jobs if j not in self.nodes.get(node, [])]
            if kept:
                self.parked[node] = kept
            else:
                del self.parked[node]
        return _Record.encode(self)


def _drop(where: dict[str, list[str]], node: str, job: str) -> None:
    jobs = where.get(node, [])
    if job in jobs:
        jobs.remove(job)
    if not jobs:
        where.pop(node, None)


class SwitchPhase(enum.Enum):
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    ROLLBACK = "rollback"


class SwitchKind(enum.Enum):
    """What a switch is for, read from the two fields the record stores (``prefetch``,
    ``operation``: what replicas of earlier versions read)."""

    HANDOVER = "handover"  # the group is free: bring the head waiter in, then grant it
    # Beside the hold: bring a waiter's state in while the holder runs (or the holder's own,
    # on a node that came back without it: its catch-up); ends without a grant.
    PREFETCH = "prefetch"
    OPERATION = "operation"  # an operator's snapshot or restore; ends without a grant


@dataclass(slots=True)
class NodeStep:
    """One node's part of a switch: what leaves the devices and what comes back."""

    node: str
    evict: str  # job to checkpoint on this node, "" if none
    restore: str  # job to restore on this node, "" if none


@dataclass(slots=True)
class SwitchRecord(_Record):
    switch_id: str
    group: str
    to_job: str
    to_revision: int  # create revision of the waiter's queue entry being served
    steps: list[NodeStep]
    phase: SwitchPhase
    driver: str
    started_at: float
    attempt: int = 1
    # Begun beside a holder (a prefetch, a catch-up, or an operation): the holder runs on.
    prefetch: bool = False
    # Nodes fenced out during this switch: never sent another directive of it, whatever
    # driver carries it on; their residency is unknown until their next hello.
    fenced: list[str] = field(default_factory=list)
    # The operator operation (snapshot / restore) this switch runs: it ends without a grant
    # and writes the operation's outcome in the transaction that closes it ("" if none).
    operation: str = ""
    # Device bytes the CHECKPOINT phase moved (kept across a driver crash for the outcome).
    evicted_bytes: int = 0

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        data = _known(cls, data)
        data["steps"] = [NodeStep(**_known(NodeStep, s)) for s in data["steps"]]
        data["phase"] = SwitchPhase(data["phase"])
        return cls(**data)

    @property
    def kind(self) -> SwitchKind:
        if self.operation:
            return SwitchKind.OPERATION
        return SwitchKind.PREFETCH if self.prefetch else SwitchKind.HANDOVER

    @property
    def from_jobs(self) -> list[str]:
        return sorted({s.evict for s in self.steps if s.evict})


class OperationKind(enum.Enum):
    SNAPSHOT = "snapshot"  # checkpoint the job on the node, restore nothing
    RESTORE = "restore"  # restore the job on the node, grant nothing


class OperationState(enum.Enum):
    PENDING = "pending"  # recorded; runs when the group has no switch in flight
    RUNNING = "running"  # its switch record is written
    SUCCEEDED = "succeeded"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (OperationState.SUCCEEDED, OperationState.FAILED)


@dataclass(slots=True)
class OperationRecord(_Record):
    """An operator snapshot or restore of one job on one node of a group.

    Written PENDING by the node's request, RUNNING with the switch record that carries it out,
    SUCCEEDED or FAILED in the transaction that closes that switch (or at once, when there is
    nothing to move or the group no longer allows it). It lives on its own lease: it expires
    ``retention`` seconds after the request, whatever its state.
    """

    operation_id: str
    kind: OperationKind
    group: str
    job: str
    node: str
    requested_at: float
    state: OperationState = OperationState.PENDING
    finished_at: float = 0.0
    bytes_moved: int = 0  # device bytes the job's checkpoint (snapshot) or restore moved
    error: str = ""
    switch_id: str = ""

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        data = _known(cls, data)
        data["kind"] = OperationKind(data["kind"])
        data["state"] = OperationState(data["state"])
        return cls(**data)

    @property
    def elapsed_seconds(self) -> float:
        """From the request to the outcome (to now while it is not finished)."""
        end = self.finished_at if self.state.done else time.time()
        return max(0.0, end - self.requested_at)


@dataclass(slots=True)
class MembersRecord(_Record):
    """Nodes an operator pinned to a group, on top of those its registrations bring."""

    nodes: list[str] = field(default_factory=list)


@dataclass(slots=True)
class JobUsageRecord:
    """One job's use of a group: totals, and the sums its phase-to-phase variation comes from
    (squared hold lengths; grant-to-grant intervals and their squares)."""

    held_seconds: float = 0.0
    holds: int = 0
    first_seen: float = 0.0
    last_seen: float = 0.0
    held_sq: float = 0.0
    last_granted: float = 0.0
    last_session: str = ""  # an interval counts only within one session (one run of the job)
    periods: int = 0
    period_sum: float = 0.0
    period_sq: float = 0.0


# What a replica before the phase sums reads of each job (strictly: ``JobUsageRecord(**u)``).
_USAGE_TOTALS = ("held_seconds", "holds", "first_seen", "last_seen")
_USAGE_PHASES = ("held_sq", "last_granted", "last_session", "periods", "period_sum", "period_sq")


@dataclass(slots=True)
class UsageRecord(_Record):
    """Accelerator time each job held a group: the fair-share ledger and the phase history
    the placement advisor reads."""

    jobs: dict[str, JobUsageRecord] = field(default_factory=dict)

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        phases = data.get("phases", {})
        jobs = {}
        for job, totals in data["jobs"].items():
            sums = phases.get(job, {})
            try:  # the shape this version writes, read on every write of the key
                jobs[job] = JobUsageRecord(**totals, **sums)
            except TypeError:  # a field of another version: kept out
                fields = {k: v for k, v in totals.items() if k in _USAGE_TOTALS}
                fields |= {k: v for k, v in sums.items() if k in _USAGE_PHASES}
                jobs[job] = JobUsageRecord(**fields)
        return cls(jobs)

    def encode(self) -> bytes:
        # The phase sums travel beside each job's totals, not inside them: a replica of the
        # version before decodes the totals strictly and ignores a key it does not know
        # (during a rolling upgrade its rewrite drops the sums: they start again).
        jobs = {}
        phases = {}
        for j, u in self.jobs.items():
            jobs[j] = {
                "held_seconds": u.held_seconds,
                "holds": u.holds,
                "first_seen": u.first_seen,
                "last_seen": u.last_seen,
            }
            phases[j] = {
                "held_sq": u.held_sq,
                "last_granted": u.last_granted,
                "last_session": u.last_session,
                "periods": u.periods,
                "period_sum": u.period_sum,
                "period_sq": u.period_sq,
            }
        return _ENCODER.encode({"jobs": jobs, "phases": phases}).encode()

    def copy(self) -> UsageRecord:
        """A copy to edit."""
        return UsageRecord({job: dataclasses.replace(u) for job, u in self.jobs.items()})

    def add(self, job: str, granted_at: float, released_at: float, session: str = "") -> None:
        """Count one hold of ``job`` (of its ``session``): the time between two grants is a
        period only within one session, not across a restart of the job."""
        usage = self.jobs.setdefault(job, JobUsageRecord(first_seen=granted_at))
        held = max(0.0, released_at - granted_at)
        usage.held_seconds += held
        usage.held_sq += held * held
        same_run = bool(session) and session == usage.last_session
        if same_run and granted_at > usage.last_granted:
            period = granted_at - usage.last_granted
            usage.periods += 1
            usage.period_sum += period
            usage.period_sq += period * period
        usage.last_granted = granted_at
        usage.last_session = session
        usage.holds += 1
        usage.last_seen = released_at


@dataclass(slots=True)
class FaultRecord(_Record):
    reason: str
    at: float


@dataclass(slots=True)
class FenceRecord(_Record):
    """Why a node was fenced out of its groups (its key's mod revision is the fence floor)."""

    reason: str
    at: float
    replica: str
    groups: list[str] = field(default_factory=list)  # where its residency was marked unknown


@dataclass(slots=True)
class GroupStats(_Record):
    switches: int = 0
    grants: int = 0
    last_error: str = ""
    last_switch_seconds: float = 0.0
    rollbacks: int = 0  # switches that failed before the commit and were rolled back
    faults: int = 0  # waiters given up on after their switch failed for good


@dataclass(slots=True)
class WorkerRecord:
    job: str
    group: str
    pid: int
    state_bytes: int
    app_callbacks: bool = False
    acquirer: bool = False


@dataclass(slots=True)
class AgentRecord(_Record):
    node: str
    replica: str
    backend: str
    emulated: bool
    connected_at: float
    workers: list[WorkerRecord] = field(default_factory=list)
    devices: int = 0
    capacity_bytes: int = 0  # 0: one job's state at a time
    default_state_bytes: int = 0

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        data = _known(cls, data)
        data["workers"] = [WorkerRecord(**_known(WorkerRecord, w)) for w in data["workers"]]
        return cls(**data)

    def jobs_of(self, group: str) -> set[str]:
        return {w.job for w in self.workers if w.group == group}

    def job_bytes(self, job: str) -> int:
        """Device bytes of ``job`` on this node, as its workers announced them."""
        announced = sum(w.state_bytes for w in self.workers if w.job == job)
        return announced or self.default_state_bytes


T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Stored(Generic[T]):
    """A decoded record with the etcd metadata that fencing and compares need."""

    record: T
    create_revision: int
    mod_revision: int
    lease: int

    @classmethod
    def of(cls, kv: KeyValue, record: T) -> Stored[T]:
        return cls(record, kv.create_revision, kv.mod_revision, kv.lease)


def hold_epoch(hold: Stored[HolderRecord]) -> int:
    """A hold's fencing epoch: its key's create revision, or, for a hold a hand-over wrote
    over the previous one, the revision of that write (kept in the record once rewritten).
    Either way it is above the epoch of every earlier hold of the group."""
    record = hold.record
    if record.epoch:
        return record.epoch
    return hold.mod_revision if record.handed_over else hold.create_revision


@dataclass(frozen=True, slots=True)
class Hint(Generic[T]):
    """A key as this replica's mirror last saw it, offered to a transaction to save a read.

    ``Hint(None)`` says the mirror saw no such key; passing no hint at all (None) says nothing
    is known and the store reads the key. The transaction compares what the hint claims, so a
    stale hint costs a retry, never a wrong answer.
    """

    seen: T | None


@dataclass(slots=True)
class QueuedJob:
    """A waiter: the job and its queue entry, whose create revision is its place in line."""

    job: str
    entry: Stored[QueueRecord]

    @property
    def revision(self) -> int:
        return self.entry.create_revision


@dataclass(slots=True)
class RelayRecord(_Record):
    """A directive posted for an agent whose stream another replica holds, and its ack.

    Payloads are the protobuf bytes, base64-encoded: the store stays ignorant of gRPC types.
    """

    driver: str
    directive: str
    ack: str = ""


@dataclass(slots=True)
class PoolPin:
    job: str
    role: str
    group: str


@dataclass(slots=True)
class PoolRecord(_Record):
    """A placement pool (``pools/<pool>/config``): its groups in order (the order breaks the
    optimizer's ties), the load cap of a shared group, and the operators' rules."""

    groups: list[str]
    cap: float
    created_at: float
    pins: list[PoolPin] = field(default_factory=list)
    excluded: list[list[str]] = field(default_factory=list)  # pairs of jobs, each sorted
    drained: list[str] = field(default_factory=list)
    # group -> its launcher handle: the Kubernetes ResourceClaim the group's pods name.
    claims: dict[str, str] = field(default_factory=dict)

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        # The fields this version added after the first (claims) default when an older one
        # wrote it.
        data = _known(cls, data)
        data["pins"] = [PoolPin(**_known(PoolPin, p)) for p in data.get("pins", [])]
        return cls(**data)


@dataclass(slots=True)
class DeclaredProfile:
    """A role's profile as the job declared it, or as it was measured (source)."""

    busy: float
    period_seconds: float
    cv: float
    mode: str  # "sync" / "async"
    switch_seconds: float
    source: str  # "measured" / "declared" / "default"


@dataclass(slots=True)
class RoleAssignment:
    """Where one role of one job was placed, why, and the usage of its group when it was (the
    measured profile at the next restart point is the usage since then)."""

    group: str
    decision: str
    reason: str
    profile: DeclaredProfile
    placed_at: float
    replica: str
    predicted_duty: float = 0.0
    held_seconds: float = 0.0  # the job's usage of the group when placed
    holds: int = 0
    last_seen: float = 0.0
    held_sq: float = 0.0  # and its phase sums then (JobUsageRecord)
    periods: int = 0
    period_sum: float = 0.0
    period_sq: float = 0.0
    own_reason: str = ""  # the reason with other jobs' ids hidden (the job's own reads)

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        data = _known(cls, data)
        data["profile"] = DeclaredProfile(**_known(DeclaredProfile, data["profile"]))
        return cls(**data)


@dataclass(slots=True)
class PoolAssignmentsRecord(_Record):
    """Every assignment of a pool (``pools/<pool>/assignments``), by job then role: one key,
    so that one compare covers the whole pool's load when a placement is written."""

    jobs: dict[str, dict[str, RoleAssignment]] = field(default_factory=dict)
    # Expected duty per group as the last placement predicted it.
    expected: dict[str, float] = field(default_factory=dict)

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        jobs = {
            job: {role: RoleAssignment._from_dict(a) for role, a in roles.items()}
            for job, roles in data["jobs"].items()
        }
        return cls(jobs, dict(data.get("expected", {})))


@dataclass(slots=True)
class AuditEntryRecord:
    at: float
    what: str
    job: str = ""
    role: str = ""
    group: str = ""
    previous_group: str = ""
    reason: str = ""
    replica: str = ""
    own_reason: str = ""  # the reason with other jobs' ids hidden (the job's own reads)


@dataclass(slots=True)
class PoolAuditRecord(_Record):
    """The pool's last placements and rule changes (``pools/<pool>/audit``), oldest first."""

    entries: list[AuditEntryRecord] = field(default_factory=list)

    @classmethod
    def _from_dict(cls, data: dict[str, Any]) -> Self:
        return cls([AuditEntryRecord(**_known(AuditEntryRecord, e)) for e in data["entries"]])
