"""Who reads which group, and how much of it (``timeslice_orchestrator.visibility``).

The e2e side (real replicas, mutual TLS, every read RPC of both APIs) is
tests/integration/test_read_scope.py; here the rules themselves, on records and messages built
by hand: who is which viewer, what makes a group a job's, and that a job's view of a status
names no other job anywhere, whatever the status holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import cast

import pytest

from tests.unit import views
from tests.unit.views import GROUP, agent, agents, holder, stored, switch_to, waiter
from timeslice import AcquireStage
from timeslice.errors import InvalidArgument, NotFound, PermissionDenied
from timeslice.ids import validate_job_id
from timeslice_orchestrator.api import _event, group_status, own_groups
from timeslice_orchestrator.identity import Identity
from timeslice_orchestrator.locks import Progress
from timeslice_orchestrator.store.etcd import EtcdClient, KeyValue
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import (
    AgentRecord,
    FaultRecord,
    JobUsageRecord,
    NodeStep,
    OperationKind,
    OperationRecord,
    ResidentRecord,
    Stored,
    SwitchPhase,
    SwitchRecord,
    UsageRecord,
)
from timeslice_orchestrator.visibility import (
    EVERYTHING,
    OTHER_JOB,
    Reach,
    Viewer,
    group_jobs,
    hidden,
    scoped_status,
    scoped_summary,
    scoped_v1alpha1,
    viewer_of,
)
from timeslice_proto.timeslice.v1 import (
    AcquireEvent,
    FaultedJob,
    GroupStatus,
    GroupSummary,
    JobUsage,
    NodeResidency,
    QueueEntry,
    SwitchStatus,
)
from timeslice_proto.timeslice_orchestrator import v1alpha1

ME, OTHER, THIRD = "job-mine", "job-other", "job-third"
VIEWER = Viewer(Reach.JOB, ME, "'mine' (job job-mine)")


# -- who is which viewer ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("who", "operator", "expected"),
    [
        (None, False, EVERYTHING),  # plaintext: no identity, reads unchanged
        (Identity("op", operator=True), False, EVERYTHING),
        (Identity("j", job="j"), True, EVERYTHING),  # a job certificate with the token
        (Identity("j", job="j"), False, Viewer(Reach.JOB, "j", "'j' (job j)")),
        (Identity("n", job="j", node="n"), False, Viewer(Reach.JOB, "j", "'n' (job j, node n)")),
        (Identity("n", node="n"), False, Viewer(Reach.NONE, who="'n' (node n)")),
        (Identity("x"), False, Viewer(Reach.NONE, who="'x' (no timeslice role)")),
    ],
)
def test_the_viewer_comes_from_the_identity(
    who: Identity | None, operator: bool, expected: Viewer
) -> None:
    assert viewer_of(who, operator=operator) == expected


def test_only_a_viewer_without_reach_is_refused() -> None:
    node = viewer_of(Identity("n", node="n"))
    with pytest.raises(PermissionDenied, match="reads no groups"):
        node.check_reads("ListGroups")
    EVERYTHING.check_reads("ListGroups")
    VIEWER.check_reads("ListGroups")
    assert not node.sees(views.view(holding=holder("n", 10)), {})


def test_names_are_replaced_except_the_viewers_own_and_none() -> None:
    assert [VIEWER.name(j) for j in (ME, OTHER, "")] == [ME, OTHER_JOB, ""]
    assert [EVERYTHING.name(j) for j in (ME, OTHER)] == [ME, OTHER]


def test_the_marker_is_no_job_id() -> None:
    with pytest.raises(InvalidArgument):
        validate_job_id(OTHER_JOB)


def test_a_grant_names_the_previous_job_only_to_itself_and_operators() -> None:
    step = Progress(AcquireStage.GRANTED, epoch=9, restored=True, previous_job=OTHER)
    assert _event(step, VIEWER).previous_job_id == OTHER_JOB
    assert _event(step, EVERYTHING).previous_job_id == OTHER
    again = dataclasses.replace(step, previous_job=ME)
    assert _event(again, VIEWER).previous_job_id == ME
    assert _event(dataclasses.replace(step, previous_job=""), VIEWER).previous_job_id == ""


# -- which groups are a job's ----------------------------------------------------------------


def _operation(job: str) -> GroupView:
    op = OperationRecord("op-1", OperationKind.SNAPSHOT, GROUP, job, "n1", 1.0)
    return dataclasses.replace(views.view(), operations={"op-1": stored(op, 9)})


def _usage(job: str) -> GroupView:
    ledger = stored(UsageRecord({job: JobUsageRecord(held_seconds=1.0, holds=1)}), 5)
    return dataclasses.replace(views.view(), usage=ledger)


def _switch(to: str, *, evict: str) -> Stored[SwitchRecord]:
    """A switch towards ``to`` that checkpoints ``evict`` on n1."""
    record = switch_to(to, 6, 11).record
    return stored(dataclasses.replace(record, steps=[NodeStep("n1", evict, to)]), 11)


MEMBERSHIPS: dict[str, tuple[GroupView, dict[str, AgentRecord]]] = {
    "holds it": (views.view(holding=holder(ME, 10)), {}),
    "waits in its queue": (views.view([waiter(OTHER, 5), waiter(ME, 6)]), {}),
    "a switch brings it in": (views.view(switch=switch_to(ME, 6, 11)), {}),
    "a switch takes it out": (views.view(switch=_switch(OTHER, evict=ME)), {}),
    "it is faulted there": (views.view(faults={ME: ("checkpoint failed", 7)}), {}),
    "its state is resident": (views.view(resident={"n1": [OTHER, ME]}), {}),
    "a worker of it is registered": (views.view(), agents(agent("n1", {ME: 1}))),
    "an operator operation is on it": (_operation(ME), {}),
    "it held the group before": (_usage(ME), {}),
}


@pytest.mark.parametrize("why", sorted(MEMBERSHIPS))
def test_a_group_is_the_jobs_when_it_records_the_job(why: str) -> None:
    view, registered = MEMBERSHIPS[why]
    assert ME in group_jobs(view, registered)
    assert VIEWER.sees(view, registered)


def test_a_group_that_records_only_others_is_not_the_jobs() -> None:
    view = views.view(
        [waiter(OTHER, 5)],
        holding=holder(THIRD, 4),
        resident={"n1": [THIRD]},
        faults={OTHER: ("x", 6)},
        held={THIRD: 3.0},
    )
    # A worker of the job registered for another group does not count.
    registered = agents(agent("n1", {THIRD: 1}), agent("n2", {ME: 1}, group="elsewhere"))
    assert group_jobs(view, registered) == {OTHER, THIRD}
    assert not VIEWER.sees(view, registered)
    assert EVERYTHING.sees(view, registered)


def test_a_group_that_does_not_exist_is_nobodys() -> None:
    gone = dataclasses.replace(views.view(holding=holder(ME, 3)), exists=False)
    assert not VIEWER.sees(gone, {}) and not EVERYTHING.sees(gone, {})


def test_another_jobs_group_and_a_missing_one_answer_alike() -> None:
    error = hidden("g1", VIEWER)
    assert isinstance(error, NotFound)
    assert str(error) == str(hidden("g2", VIEWER)).replace("g2", "g1")


# -- what a job reads of its group -----------------------------------------------------------


def _full_status() -> GroupStatus:
    """A status with every field set, naming the viewer and two other jobs."""
    return GroupStatus(
        group_id=GROUP,
        holder_job_id=OTHER,
        holder_epoch=42,
        held_since=100.0,
        queue=[
            QueueEntry(job_id=THIRD, priority=5, enqueued_at=1.0, revision=7),
            QueueEntry(job_id=ME, priority=1, enqueued_at=2.0, revision=9),
        ],
        nodes=[
            NodeResidency(node="n1", resident_job_id=OTHER, resident_jobs=[ME, OTHER]),
            NodeResidency(node="n2", resident_job_id="", resident_jobs=[]),
        ],
        switch=SwitchStatus(
            switch_id="sw-1",
            epoch=41,
            from_job_id=f"{THIRD},{ME}",
            to_job_id=OTHER,
            started_at=99.0,
        ),
        faulted=[
            FaultedJob(job_id=ME, reason="my checkpoint failed"),
            FaultedJob(job_id=THIRD, reason=f"pid 77 of {THIRD}: /home/{THIRD}/ckpt"),
        ],
        last_error=f"switch to {OTHER} failed",
        switches=12,
        driver_replica="r1",
        static_members=["n1"],
        usage=[
            JobUsage(job_id=ME, held_seconds=3.0, holds=2, first_seen=1.0, last_seen=4.0),
            JobUsage(job_id=OTHER, held_seconds=30.0, holds=9, first_seen=1.0, last_seen=50.0),
        ],
        policy="fifo",
        missing_members=["n3"],
    )


def test_a_job_reads_its_group_with_other_jobs_replaced() -> None:
    status = _full_status()
    before = bytes(status)
    scoped = scoped_status(VIEWER, status)
    assert bytes(status) == before  # the original is left as it was
    assert scoped == GroupStatus(
        group_id=GROUP,
        holder_job_id=OTHER_JOB,
        holder_epoch=42,
        held_since=100.0,
        queue=[
            QueueEntry(job_id=OTHER_JOB, priority=5, enqueued_at=1.0, revision=7),
            QueueEntry(job_id=ME, priority=1, enqueued_at=2.0, revision=9),
        ],
        nodes=[
            NodeResidency(node="n1", resident_job_id=OTHER_JOB, resident_jobs=[ME, OTHER_JOB]),
            NodeResidency(node="n2", resident_job_id="", resident_jobs=[]),
        ],
        switch=SwitchStatus(
            switch_id="sw-1",
            epoch=41,
            from_job_id=f"{OTHER_JOB},{ME}",
            to_job_id=OTHER_JOB,
            started_at=99.0,
        ),
        faulted=[
            FaultedJob(job_id=ME, reason="my checkpoint failed"),
            FaultedJob(job_id=OTHER_JOB, reason=""),
        ],
        last_error="",
        switches=12,
        driver_replica="r1",
        static_members=["n1"],
        usage=[JobUsage(job_id=ME, held_seconds=3.0, holds=2, first_seen=1.0, last_seen=4.0)],
        policy="fifo",
        missing_members=["n3"],
    )
    assert scoped_status(EVERYTHING, status) is status


def test_what_group_status_builds_names_no_other_job_once_scoped() -> None:
    """From records to the wire: every field group_status fills, with other jobs in each."""
    view = views.view(
        [waiter(THIRD, 5), waiter(ME, 6)],
        holding=holder(OTHER, 4),
        resident={"n1": [THIRD, OTHER], "n2": [ME]},
        switch=_switch(ME, evict=THIRD),
        faults={THIRD: (f"{THIRD} crashed", 3)},
        held={OTHER: 5.0, THIRD: 1.0, ME: 2.0},
    )
    view.stats.last_error = f"switch to {THIRD} failed on n1"
    registered = agents(agent("n1", {OTHER: 1, ME: 1}), agent("n3", {THIRD: 1}))
    status = group_status(view, cast(Mirror, None), registered)
    shown = bytes(status)
    assert OTHER.encode() in shown and THIRD.encode() in shown  # the test means something
    scoped = bytes(scoped_status(VIEWER, status))
    assert OTHER.encode() not in scoped and THIRD.encode() not in scoped
    assert ME.encode() in scoped


def test_a_listing_line_and_a_v1alpha1_status_are_scoped_alike() -> None:
    line = GroupSummary(group_id=GROUP, holder_job_id=OTHER, queue_length=3, switching=True)
    assert scoped_summary(VIEWER, line) == GroupSummary(GROUP, OTHER_JOB, 3, True)
    assert scoped_summary(EVERYTHING, line) is line
    mine = GroupSummary(group_id=GROUP, holder_job_id=ME, queue_length=0)
    assert scoped_summary(VIEWER, mine) == mine

    states = v1alpha1.SnapshotAgentJobStateState
    response = v1alpha1.GetGroupStatusResponse(
        group=v1alpha1.GroupStatus(
            group_id=GROUP,
            locking_job=OTHER,
            active_job=OTHER,
            waiter_queue_depth=2,
            loaded_job=THIRD,
        ),
        agent_job_states=[
            v1alpha1.SnapshotAgentJobState(agent="n1", job_state=states.RUNNING, job_id=OTHER),
            v1alpha1.SnapshotAgentJobState(agent="n1", job_state=states.SAVED, job_id=ME),
        ],
    )
    scoped = scoped_v1alpha1(VIEWER, response)
    assert scoped.group is not None
    assert (scoped.group.locking_job, scoped.group.active_job, scoped.group.loaded_job) == (
        OTHER_JOB,
        OTHER_JOB,
        OTHER_JOB,
    )
    assert scoped.group.waiter_queue_depth == 2
    assert [(s.job_id, s.job_state) for s in scoped.agent_job_states] == [
        (OTHER_JOB, states.RUNNING),
        (ME, states.SAVED),
    ]
    assert OTHER.encode() not in bytes(scoped) and THIRD.encode() not in bytes(scoped)
    assert scoped_v1alpha1(EVERYTHING, response) is response


# The fields of every message the scoped reads send, as visibility.py was written for them. A
# new field that may name a job must be scoped there too; then add it here.
KNOWN_FIELDS: dict[type, set[str]] = {
    GroupStatus: {
        "group_id", "holder_job_id", "holder_epoch", "held_since", "queue", "nodes", "switch",
        "faulted", "last_error", "switches", "driver_replica", "static_members", "usage",
        "policy", "missing_members",
    },
    QueueEntry: {"job_id", "priority", "enqueued_at", "revision"},
    NodeResidency: {"node", "resident_job_id", "resident_jobs", "backend", "emulated"},
    SwitchStatus: {"switch_id", "epoch", "from_job_id", "to_job_id", "phase", "started_at"},
    FaultedJob: {"job_id", "reason"},
    JobUsage: {"job_id", "held_seconds", "holds", "first_seen", "last_seen"},
    GroupSummary: {"group_id", "holder_job_id", "queue_length", "switching"},
    AcquireEvent: {
        "state", "queue_position", "epoch", "waited_seconds", "restored", "previous_job_id",
        "switch_seconds", "ticket", "warning",
    },
    v1alpha1.GetGroupStatusResponse: {"group", "agent_job_states"},
    v1alpha1.GroupStatus: {
        "group_id", "group_state", "state_timestamp", "locking_job", "active_job",
        "waiter_queue_depth", "loaded_job",
    },
    v1alpha1.SnapshotAgentJobState: {"agent", "job_state", "job_id"},
}  # fmt: skip


@pytest.mark.parametrize("message", list(KNOWN_FIELDS), ids=lambda m: m.__qualname__)
def test_every_field_a_read_sends_was_considered(message: type) -> None:
    assert {f.name for f in dataclasses.fields(message)} == KNOWN_FIELDS[message]


# -- a job's listing: the pre-filter on the mirror's bytes drops no group of the job ---------


def _mirror(records: dict[bytes, bytes]) -> Mirror:
    """A mirror holding ``records`` (key -> encoded value) as its watch would have stored
    them, without etcd."""
    keys = Keyspace("/t")
    mirror = Mirror(cast(EtcdClient, None), keys)
    for revision, (key, value) in enumerate(records.items(), 1):
        ref = keys.parse(key)
        assert ref is not None, key
        mirror._store(ref, KeyValue(key, value, revision, revision, 1, 0))
    return mirror


def test_a_jobs_listing_finds_each_kind_of_group_of_its_own() -> None:
    keys = Keyspace("/t")
    step = [NodeStep("n1", "", "")]
    switch = SwitchRecord("sw", "", "", 0, step, SwitchPhase.CHECKPOINT, "r1", 1.0)
    faulted = FaultRecord(reason="x", at=1.0)
    records = {
        keys.holder("holds"): holder(ME, 1).record.encode(),
        keys.queue_entry("waits", ME): waiter(ME, 2).entry.record.encode(),
        keys.switch("switched-in"): dataclasses.replace(switch, to_job=ME).encode(),
        keys.switch("switched-out"): dataclasses.replace(
            switch, to_job=OTHER, steps=[NodeStep("n1", ME, OTHER)]
        ).encode(),
        keys.fault("faulted", ME): faulted.encode(),
        keys.operation("operated", "op-1"): OperationRecord(
            "op-1", OperationKind.SNAPSHOT, "operated", ME, "n1", 1.0
        ).encode(),
        keys.resident("resident"): ResidentRecord({"n1": [OTHER, ME]}).encode(),
        keys.usage("held-before"): UsageRecord({ME: JobUsageRecord(1.0, 1)}).encode(),
        keys.agent("n1"): agent("n1", {ME: 1}, group="registered").encode(),
        keys.stats("registered"): b"{}",  # the group exists (its agent alone would not make it)
        # Groups of others, one of them named like the job: looked at, and left out.
        keys.holder(f"{ME}-lookalike"): holder(OTHER, 3).record.encode(),
        keys.queue_entry("theirs", OTHER): waiter(OTHER, 4).entry.record.encode(),
        keys.fault("theirs", THIRD): faulted.encode(),
    }
    mirror = _mirror(records)
    expected = {
        "faulted", "held-before", "holds", "operated", "registered", "resident",
        "switched-in", "switched-out", "waits",
    }  # fmt: skip
    listed = asyncio.run(own_groups(mirror, VIEWER))
    assert {v.group for v in listed} == expected
    everyone = {*expected, f"{ME}-lookalike", "theirs"}
    assert set(mirror.group_names()) == everyone
    assert {v.group for v in asyncio.run(own_groups(mirror, Viewer(Reach.JOB, OTHER)))} == {
        "switched-out",
        "resident",
        f"{ME}-lookalike",
        "theirs",
    }
