"""Operator operations: what the group allows (plan_operation) and what the agent answers."""

from __future__ import annotations

from tests.unit.views import GB, agent, agents, holder, view
from timeslice_agent.llmd import operation_response
from timeslice_orchestrator.store.records import (
    NodeStep,
    OperationKind,
    OperationRecord,
)
from timeslice_orchestrator.switch_plan import plan_operation
from timeslice_proto.snapshot_agent.v1alpha1 import OperationStatus
from timeslice_proto.timeslice.v1 import NodeOperation, OperationState


def op(kind: OperationKind, job: str, node: str = "n1") -> OperationRecord:
    return OperationRecord("op-1", kind, "g", job, node, requested_at=1.0)


SNAPSHOT, RESTORE = OperationKind.SNAPSHOT, OperationKind.RESTORE
ONE_AT_A_TIME = agents(agent("n1", {"a": GB, "b": GB}), agent("n2", {"a": GB, "b": GB}))
TWO_FIT = agents(agent("n1", {"a": GB, "b": GB}, capacity=2 * GB))


def test_snapshot_evicts_a_job_that_does_not_hold_on_its_node_only() -> None:
    group = view(resident={"n1": ["a"], "n2": ["a"]})
    assert plan_operation(group, op(SNAPSHOT, "a"), ONE_AT_A_TIME, False) == [
        NodeStep(node="n1", evict="a", restore="")
    ]
    # Beside another job's hold, too: the holder's state is not touched.
    beside = view(holding=holder("b", 5), resident={"n1": ["a", "b"]})
    assert plan_operation(beside, op(SNAPSHOT, "a"), TWO_FIT, False) == [
        NodeStep(node="n1", evict="a", restore="")
    ]


def test_snapshot_of_the_holder_or_of_a_job_not_on_the_devices_is_refused() -> None:
    held = view(holding=holder("a", 5), resident={"n1": ["a"]})
    assert "yield first" in str(plan_operation(held, op(SNAPSHOT, "a"), ONE_AT_A_TIME, False))
    parked = view(resident={"n1": ["b"]})
    assert "not on node n1" in str(plan_operation(parked, op(SNAPSHOT, "a"), ONE_AT_A_TIME, False))


def test_restore_on_a_free_group_evicts_what_is_there_and_grants_nothing() -> None:
    group = view(resident={"n1": ["b"], "n2": ["b"]})
    assert plan_operation(group, op(RESTORE, "a"), ONE_AT_A_TIME, False) == [
        NodeStep(node="n1", evict="b", restore="a")
    ]
    assert plan_operation(view(), op(RESTORE, "a"), ONE_AT_A_TIME, False) == [
        NodeStep(node="n1", evict="", restore="a")
    ]
    # Already there: nothing to move.
    assert (
        plan_operation(view(resident={"n1": ["a"]}), op(RESTORE, "a"), ONE_AT_A_TIME, False) == []
    )


def test_restore_beside_another_hold_only_when_it_fits() -> None:
    held = view(holding=holder("b", 5), resident={"n1": ["b"]})
    refused = plan_operation(held, op(RESTORE, "a"), ONE_AT_A_TIME, False)
    assert isinstance(refused, str) and "held by b" in refused
    assert plan_operation(held, op(RESTORE, "a"), TWO_FIT, False) == [
        NodeStep(node="n1", evict="", restore="a")
    ]
    # The holder's own restore (a catch-up) may evict what else is on the node.
    mine = view(holding=holder("a", 5), resident={"n1": ["b"]})
    assert plan_operation(mine, op(RESTORE, "a"), ONE_AT_A_TIME, False) == [
        NodeStep(node="n1", evict="b", restore="a")
    ]


def test_a_job_without_a_worker_on_the_node_or_a_node_without_an_agent_is_refused() -> None:
    group = view(resident={"n1": ["a"]})
    assert "no registered worker" in str(
        plan_operation(group, op(SNAPSHOT, "c"), ONE_AT_A_TIME, False)
    )
    assert "no agent" in str(plan_operation(group, op(RESTORE, "a", "n9"), ONE_AT_A_TIME, False))


def test_get_operation_maps_states_bytes_and_elapsed_time() -> None:
    base = NodeOperation(operation_id="op-1", requested_at=10.0)
    for state in (OperationState.PENDING, OperationState.RUNNING):
        base.state = state
        answer = operation_response(base, now=10.25)
        assert answer.status is OperationStatus.PENDING and answer.elapsed_ms == 250
        assert answer.storage_bytes is None and answer.error is None
    done = NodeOperation(
        operation_id="op-1",
        state=OperationState.SUCCEEDED,
        requested_at=10.0,
        finished_at=11.5,
        bytes_moved=3 * GB,
    )
    answer = operation_response(done, now=99.0)
    assert answer.status is OperationStatus.COMPLETE and answer.elapsed_ms == 1500
    assert answer.storage_bytes == answer.snapshot_device_bytes == 3 * GB
    failed = NodeOperation(
        state=OperationState.FAILED, requested_at=10.0, finished_at=10.1, error="held by b"
    )
    answer = operation_response(failed)
    assert answer.status is OperationStatus.FAILED and answer.error == "held by b"
