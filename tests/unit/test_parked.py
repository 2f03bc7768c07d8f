"""Parked state in the residency record, and the rule that holds back a job parked on a node
that cannot restore it (issue 37, 8)."""

from __future__ import annotations

from tests.unit.views import GB, agent, agents, stored, view
from timeslice_orchestrator.grants import in_place
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import ResidentRecord
from timeslice_orchestrator.switch_plan import stranded


def _with(group: GroupView, record: ResidentRecord) -> GroupView:
    group.resident = stored(record, 4)
    return group


def test_a_checkpoint_parks_a_job_and_a_restore_brings_it_back() -> None:
    record = ResidentRecord({"n1": ["a"], "n2": ["a"]})
    record.park("n1", "a")
    assert record == ResidentRecord({"n2": ["a"]}, {"n1": ["a"]})
    record.park("n1", "a")  # once
    assert record.parked == {"n1": ["a"]}
    record.place("n1", "a")
    assert record == ResidentRecord({"n2": ["a"], "n1": ["a"]})
    record.park("n2", "a")
    record.forget("n2", "a")  # its workers there left
    assert record == ResidentRecord({"n1": ["a"]})


def test_a_job_on_a_nodes_devices_is_never_written_as_parked_there() -> None:
    # What a hello's report, written straight into ``nodes``, settles.
    record = ResidentRecord({"n1": ["a"]}, {"n1": ["a", "b"], "n2": ["a"]})
    decoded = ResidentRecord.decode(record.encode())
    assert decoded == ResidentRecord({"n1": ["a"]}, {"n1": ["b"], "n2": ["a"]})


def test_a_record_of_an_older_replica_has_nothing_parked() -> None:
    assert ResidentRecord.decode(b'{"nodes":{"n1":["a"]}}') == ResidentRecord({"n1": ["a"]})


def test_a_job_parked_on_a_node_whose_agent_is_away_is_stranded() -> None:
    record = ResidentRecord({"n1": ["b"]}, {"n1": ["a"], "n2": ["a"]})
    present = agents(agent("n1", {"a": GB, "b": GB}))  # n2's agent is away
    assert stranded(record, "g", "a", present) == ["n2"]
    assert stranded(record, "g", "b", present) == []  # resident where it is parked nowhere
    both = agents(agent("n1", {"a": GB, "b": GB}), agent("n2", {"a": GB}))
    assert stranded(record, "g", "a", both) == []  # n2 can restore it: a switch does


def test_a_node_back_without_the_jobs_workers_cannot_restore_it_yet() -> None:
    record = ResidentRecord({}, {"n1": ["a"]})
    # A restarted agent said hello before a's registration reached it again.
    assert stranded(record, "g", "a", agents(agent("n1", {"b": GB}))) == ["n1"]
    # Workers of another group do not count.
    assert stranded(record, "g", "a", agents(agent("n1", {"a": GB}, group="h"))) == ["n1"]
    # A node pinned to the group takes part in every switch, workers or not: it restores a.
    assert stranded(record, "g", "a", agents(agent("n1", {"b": GB})), members=["n1"]) == []


def test_no_grant_in_place_for_a_stranded_job() -> None:
    present = agents(agent("n1", {"a": GB, "b": GB}))
    # a's state is on n1's devices, but parked on n2, whose agent is away.
    group = _with(view(), ResidentRecord({"n1": ["a"]}, {"n2": ["a"]}))
    assert in_place(group, "a", present) is None
    # Once n2 is back with a's workers, nothing is granted in place either: n2 must restore.
    back = agents(agent("n1", {"a": GB, "b": GB}), agent("n2", {"a": GB}))
    assert in_place(group, "a", back) is None
    # Parked nowhere that matters: granted in place as before.
    group = _with(view(), ResidentRecord({"n1": ["a"]}, {"n2": ["b"]}))
    residency = in_place(group, "a", present)
    assert residency == ResidentRecord({"n1": ["a"]}, {"n2": ["b"]})
