"""Records in etcd: compact JSON both ways, tolerant of newer fields, strict about garbage."""

from __future__ import annotations

import json

import pytest

from timeslice_orchestrator.store.records import (
    CorruptRecord,
    GroupMetaRecord,
    HolderRecord,
    ResidentRecord,
    SessionRecord,
    UsageRecord,
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
