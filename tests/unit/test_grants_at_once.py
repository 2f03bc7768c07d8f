"""When an Acquire may take a group in its own transaction instead of queueing for the driver:
exactly when the driver would grant a lone waiter in place (nothing to move)."""

from __future__ import annotations

from timeslice_orchestrator.grants import HandOvers, resident_after_grant
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import (
    AgentRecord,
    HolderRecord,
    NodeStep,
    QueuedJob,
    QueueRecord,
    ResidentRecord,
    Stored,
    SwitchPhase,
    SwitchRecord,
    WorkerRecord,
)

_SWITCH = SwitchRecord(
    "s1", "g", "y", 6, [NodeStep("n0", "x", "y")], SwitchPhase.RESTORE, "r1", 1.0
)


def _view(
    resident: dict[str, list[str]] | None = None,
    *,
    holder: bool = False,
    queue: bool = False,
    switch: bool = False,
    pinned: list[str] | None = None,
) -> GroupView:
    return GroupView(
        group="g",
        revision=10,
        exists=True,
        holder=Stored(HolderRecord("x", "s", 1.0), 5, 5, 1) if holder else None,
        queue=[QueuedJob("y", Stored(QueueRecord("s", 0, 1.0), 6, 6, 1))] if queue else [],
        resident=Stored(ResidentRecord(resident), 3, 3, 0) if resident is not None else None,
        switch=Stored(_SWITCH, 7, 7, 0) if switch else None,
        driver=None,
        driver_lease=0,
        static_members=pinned or [],
    )


def _agent(node: str, *jobs: str) -> AgentRecord:
    return AgentRecord(node, "r1", "sim", True, 1.0, [WorkerRecord(j, "g", 1, 1) for j in jobs])


def test_a_free_group_of_a_job_without_workers_is_taken_at_once() -> None:
    assert resident_after_grant(_view(), "a", {}) == ResidentRecord({})
    kept = resident_after_grant(_view({"n0": ["b"]}), "a", {})
    assert kept == ResidentRecord({"n0": ["b"]})


def test_not_while_held_queued_or_switching() -> None:
    assert resident_after_grant(_view(holder=True), "a", {}) is None
    assert resident_after_grant(_view(queue=True), "a", {}) is None
    assert resident_after_grant(_view(switch=True), "a", {}) is None


def test_only_when_the_jobs_state_is_on_every_node_it_runs_on() -> None:
    agents = {"n0": _agent("n0", "a"), "n1": _agent("n1", "a", "b")}
    assert resident_after_grant(_view({"n0": ["a"]}), "a", agents) is None  # n1 must restore
    after = resident_after_grant(_view({"n0": ["a", "b"], "n1": ["a", "b"]}), "a", agents)
    assert after == ResidentRecord({"n0": ["b", "a"], "n1": ["b", "a"]})  # a: most recent


def test_pinned_nodes_count_and_must_be_present() -> None:
    agents = {"n0": _agent("n0")}
    assert resident_after_grant(_view({}, pinned=["n0"]), "a", agents) is None
    assert resident_after_grant(_view({"n0": ["a"]}, pinned=["n0", "n1"]), "a", agents) is None
    assert resident_after_grant(_view({"n0": ["a"]}, pinned=["n0"]), "a", agents) is not None


def test_a_group_is_handed_over_only_inside_the_block_and_the_driver_hears_when_it_ends() -> None:
    hand_overs = HandOvers()
    heard: list[str] = []
    hand_overs.add_listener(heard.append)
    with hand_overs.handing("g"):
        assert "g" in hand_overs and "h" not in hand_overs
        assert heard == []  # the driver leaves it alone meanwhile
    assert "g" not in hand_overs and heard == ["g"]
    try:
        with hand_overs.handing("h"):
            raise RuntimeError("the release failed")
    except RuntimeError:
        pass
    assert "h" not in hand_overs and heard == ["g", "h"]  # told even when it failed
    hand_overs.remove_listener(heard.append)
    with hand_overs.handing("g"):
        pass
    assert heard == ["g", "h"]
