"""Records in etcd: compact JSON both ways, tolerant of newer fields, strict about garbage."""

from __future__ import annotations

import dataclasses
import json

import pytest

from timeslice_orchestrator.store import records
from timeslice_orchestrator.store.records import (
    AgentRecord,
    AuditEntryRecord,
    CorruptRecord,
    DeclaredProfile,
    GroupMetaRecord,
    HolderRecord,
    NodeStep,
    OperationKind,
    OperationRecord,
    OperationState,
    PoolAssignmentsRecord,
    PoolAuditRecord,
    PoolPin,
    PoolRecord,
    ResidentRecord,
    RoleAssignment,
    SessionRecord,
    SwitchKind,
    SwitchPhase,
    SwitchRecord,
    UsageRecord,
    WorkerRecord,
)


def test_a_record_round_trips_and_is_compact() -> None:
    holder = HolderRecord(job="a", session="s", granted_at=12.5, ticket=7, handed_over=True)
    raw = holder.encode()
    assert b" " not in raw
    assert HolderRecord.decode(raw) == holder


def test_fields_a_newer_version_added_are_ignored() -> None:
    raw = json.dumps(
        {"job": "a", "host": "h", "pid": 1, "opened_at": 2.0, "from_the_future": True}
    ).encode()
    assert SessionRecord.decode(raw) == SessionRecord(job="a", host="h", pid=1, opened_at=2.0)


@pytest.mark.parametrize("raw", [b"", b"not json", b"[1, 2]", b'"text"', b'{"job": "a"}'])
def test_garbage_or_missing_fields_raise_corrupt_record(raw: bytes) -> None:
    with pytest.raises(CorruptRecord, match="SessionRecord"):
        SessionRecord.decode(raw)


@pytest.mark.parametrize(
    ("raw", "job"),
    [
        (b"", ""),
        (b"{}", ""),
        (GroupMetaRecord(job="trainer").encode(), "trainer"),
        (b'{ "job" : "spaced" }', "spaced"),  # another writer's shape: decoded
        (b'{"job":"a","extra":1}', "a"),
    ],
)
def test_group_meta_job_of_reads_every_shape(raw: bytes, job: str) -> None:
    assert GroupMetaRecord.job_of(raw) == job


def test_group_meta_job_of_refuses_garbage() -> None:
    with pytest.raises(CorruptRecord):
        GroupMetaRecord.job_of(b"{nope")


def test_resident_place_park_forget() -> None:
    resident = ResidentRecord()
    resident.place("n0", "a")
    resident.place("n0", "b")
    resident.place("n0", "a")  # restored again: now the most recent
    assert resident.nodes == {"n0": ["b", "a"]}
    resident.park("n0", "b")
    assert resident.nodes == {"n0": ["a"]} and resident.parked == {"n0": ["b"]}
    resident.park("n0", "b")  # parking twice keeps one entry
    assert resident.parked == {"n0": ["b"]}
    resident.place("n0", "b")  # restored: no longer parked
    assert resident.parked == {}
    resident.forget("n0", "a")
    assert resident.nodes == {"n0": ["b"]}


def test_resident_encode_never_keeps_a_job_both_on_devices_and_parked() -> None:
    resident = ResidentRecord(nodes={"n0": ["a"]}, parked={"n0": ["a", "b"], "n1": ["a"]})
    decoded = ResidentRecord.decode(resident.encode())
    assert decoded.parked == {"n0": ["b"], "n1": ["a"]}


def test_usage_adds_holds_and_copies_are_independent() -> None:
    usage = UsageRecord()
    usage.add("a", granted_at=10.0, released_at=12.5)
    usage.add("a", granted_at=20.0, released_at=19.0)  # clock skew counts as nothing
    copy = usage.copy()
    copy.add("a", granted_at=30.0, released_at=31.0)
    a = usage.jobs["a"]
    assert (a.held_seconds, a.holds, a.first_seen, a.last_seen) == (2.5, 2, 10.0, 19.0)
    assert copy.jobs["a"].holds == 3
    assert UsageRecord.decode(usage.encode()) == usage


def test_usage_phase_sums_travel_beside_the_totals_an_older_replica_reads() -> None:
    usage = UsageRecord()
    for i, session in enumerate(["s1", "s1", "s1", "s2", "s2"]):
        usage.add("a", granted_at=10.0 * i, released_at=10.0 * i + 2.0, session=session)
    job = usage.jobs["a"]
    assert (job.holds, job.held_sq, job.periods, job.period_sum) == (5, 20.0, 3, 30.0)
    raw = json.loads(usage.encode())
    # What a replica from before the sums decodes strictly: exactly its four totals.
    assert set(raw["jobs"]["a"]) == {"held_seconds", "holds", "first_seen", "last_seen"}
    assert UsageRecord.decode(usage.encode()) == usage
    # Its rewrite (totals only) decodes here with the sums started again.
    older = UsageRecord.decode(json.dumps({"jobs": raw["jobs"]}).encode())
    assert older.jobs["a"].holds == 5 and older.jobs["a"].periods == 0


def test_usage_fields_of_a_newer_version_are_left_out() -> None:
    raw = json.dumps(
        {
            "jobs": {"a": {"held_seconds": 1.0, "holds": 1, "first_seen": 0.0, "last_seen": 1.0,
                           "future": 1}},
            "phases": {"a": {"held_sq": 1.0, "later": 2}},
        }
    ).encode()  # fmt: skip
    job = UsageRecord.decode(raw).jobs["a"]
    assert (job.holds, job.held_sq) == (1, 1.0)


def _from_a_newer_version(record: object) -> bytes:
    """``record`` as a newer version would write it: a field this one lacks in every record
    and every value nested in one."""

    def plain(obj: object) -> object:
        encoded = records._plain(obj)
        if dataclasses.is_dataclass(obj):
            assert isinstance(encoded, dict)
            return {**encoded, "from_the_future": {"x": [1]}}
        return encoded

    return json.dumps(record, default=plain).encode()


_PROFILE = DeclaredProfile(0.4, 10.0, 0.1, "sync", 1.5, "measured")


@pytest.mark.parametrize(
    "record",
    [
        SwitchRecord(
            switch_id="s",
            group="g",
            to_job="b",
            to_revision=7,
            steps=[NodeStep("n0", "a", "b"), NodeStep("n1", "", "b")],
            phase=SwitchPhase.RESTORE,
            driver="r0",
            started_at=1.0,
            fenced=["n1"],
            operation="op",
        ),
        OperationRecord("op", OperationKind.SNAPSHOT, "g", "a", "n0", 1.0, OperationState.RUNNING),
        AgentRecord(
            node="n0",
            replica="r0",
            backend="sim",
            emulated=True,
            connected_at=1.0,
            workers=[WorkerRecord("a", "g", 12, 1 << 30, app_callbacks=True)],
        ),
        PoolRecord(["g1", "g2"], 0.9, 1.0, pins=[PoolPin("a", "sampler", "g1")]),
        PoolAssignmentsRecord(
            {"a": {"sampler": RoleAssignment("g1", "shared", "why", _PROFILE, 1.0, "r0")}},
            {"g1": 0.8},
        ),
        PoolAuditRecord([AuditEntryRecord(1.0, "placed", job="a", group="g1")]),
        HolderRecord(job="a", session="s", granted_at=12.5, ticket=7),
    ],
    ids=lambda record: type(record).__name__,
)
def test_every_record_reads_what_a_newer_version_wrote(record: object) -> None:
    """A rolling upgrade shares etcd between two versions: a field the newer one added, at
    any depth, is left out, never a CorruptRecord (which a replica treats as a bug)."""
    decoded = type(record).decode(_from_a_newer_version(record))  # type: ignore[attr-defined]
    assert decoded == record


@pytest.mark.parametrize(
    ("prefetch", "operation", "kind"),
    [
        (False, "", SwitchKind.HANDOVER),
        (True, "", SwitchKind.PREFETCH),
        (False, "op", SwitchKind.OPERATION),
        (True, "op", SwitchKind.OPERATION),  # an operation beside a hold is an operation
    ],
)
def test_a_switch_kind_is_read_from_the_fields_an_older_replica_reads(
    prefetch: bool, operation: str, kind: SwitchKind
) -> None:
    record = SwitchRecord("s", "g", "b", 7, [], SwitchPhase.CHECKPOINT, "r0", 1.0)
    record.prefetch, record.operation = prefetch, operation
    assert SwitchRecord.decode(record.encode()).kind is kind
    assert b"kind" not in record.encode()
