"""Operator operation records against a real etcd: the request, the switch that carries one out
(RUNNING in the same transaction), its outcome written as the switch ends, and the lease that
bounds how long a record is kept."""

from __future__ import annotations

import dataclasses
import time

from tests.integration.groupstore import driver, enqueue, open_session, resident_revision, snapshot
from timeslice_orchestrator.store.etcd import KeyValue
from timeslice_orchestrator.store.groups import (
    GroupStore,
    new_operation_id,
    new_switch_id,
    operation_id_for,
)
from timeslice_orchestrator.store.records import (
    GroupStats,
    NodeStep,
    OperationKind,
    OperationRecord,
    OperationState,
    ResidentRecord,
    Stored,
    SwitchPhase,
    SwitchRecord,
)


def _op(group: str = "g") -> OperationRecord:
    return OperationRecord(
        new_operation_id(), OperationKind.SNAPSHOT, group, "a", "n0", requested_at=time.time()
    )


def _switch(op: OperationRecord) -> SwitchRecord:
    return SwitchRecord(
        switch_id=new_switch_id(),
        group="g",
        to_job="",
        to_revision=0,
        steps=[NodeStep(node="n0", evict="a", restore="")],
        phase=SwitchPhase.CHECKPOINT,
        driver="r1",
        started_at=time.time(),
        operation=op.operation_id,
    )


def _read(keys: dict[str, KeyValue], op: OperationRecord) -> OperationRecord:
    return OperationRecord.decode(keys[f"groups/g/operations/{op.operation_id}"].value)


async def test_an_operation_is_requested_run_by_a_switch_and_closed_with_it(
    store: GroupStore,
) -> None:
    await enqueue(store, await open_session(store, "b"))  # the group exists
    auth = await driver(store)
    requested = await store.request_operation(_op(), retention=60)
    assert requested is not None and requested.lease != 0
    keys = await snapshot(store)
    assert _read(keys, requested.record).state is OperationState.PENDING

    # Begun with its switch, in one transaction; a stale copy of the record cannot begin it.
    record = _switch(requested.record)
    switch = await store.begin_switch(
        "g", auth, record, await resident_revision(store), operation=requested
    )
    assert switch is not None
    keys = await snapshot(store)
    running = _read(keys, requested.record)
    assert running.state is OperationState.RUNNING and running.switch_id == record.switch_id
    assert keys[f"groups/g/operations/{running.operation_id}"].lease == requested.lease

    moved = await store.update_switch("g", auth, switch, SwitchPhase.RESTORE, evicted_bytes=42)
    assert moved is not None and moved.record.evicted_bytes == 42
    assert SwitchRecord.decode((await snapshot(store))["groups/g/switch"].value).evicted_bytes == 42

    outcome = dataclasses.replace(
        running, state=OperationState.SUCCEEDED, bytes_moved=42, finished_at=time.time()
    )
    closed = Stored(outcome, requested.create_revision, 0, requested.lease)
    ended = await store.end_switch(
        "g", auth, moved, ResidentRecord(), GroupStats(), operation=closed
    )
    assert ended is not None
    keys = await snapshot(store)
    assert "groups/g/switch" not in keys
    done = _read(keys, requested.record)
    assert done.state is OperationState.SUCCEEDED and done.bytes_moved == 42


async def test_an_expired_record_does_not_keep_its_switch_from_ending(store: GroupStore) -> None:
    await enqueue(store, await open_session(store, "b"))
    auth = await driver(store)
    requested = await store.request_operation(_op(), retention=60)
    assert requested is not None
    switch = await store.begin_switch(
        "g", auth, _switch(requested.record), await resident_revision(store), operation=requested
    )
    assert switch is not None
    await store.etcd.revoke_lease(requested.lease)  # the retention ran out mid-switch
    outcome = dataclasses.replace(requested.record, state=OperationState.FAILED, error="x")
    closed = Stored(outcome, requested.create_revision, 0, requested.lease)
    assert await store.end_switch(
        "g", auth, switch, ResidentRecord(), GroupStats(), operation=closed
    )
    keys = await snapshot(store)
    assert "groups/g/switch" not in keys
    assert not [k for k in keys if "/operations/" in k]


async def test_a_second_attempt_of_one_request_gets_the_first_record(store: GroupStore) -> None:
    """Two replicas racing with attempts of one request (one id): the first writes, the second
    gets the first's record back and writes nothing."""
    await enqueue(store, await open_session(store, "b"))
    first = dataclasses.replace(_op(), operation_id=operation_id_for("n0", "g", "req-1"))
    second = dataclasses.replace(first, requested_at=first.requested_at + 1)
    recorded = await store.request_operation(first, retention=60)
    assert recorded is not None and recorded.record is first
    before = await snapshot(store)
    again = await store.request_operation(second, retention=60)
    assert again == recorded  # the first attempt's record, with its revisions and lease
    assert await snapshot(store) == before
    assert await store.operation("g", first.operation_id) == recorded
    assert await store.operation("g", "op-unknown") is None
    # Any other request id, node or group names another record.
    named = [("n0", "g", "r"), ("n1", "g", "r"), ("n0", "h", "r"), ("n0", "g", "s")]
    assert len({operation_id_for(*k) for k in named}) == 4


async def test_no_record_for_a_group_that_does_not_exist(store: GroupStore) -> None:
    assert await store.request_operation(_op("nowhere"), retention=60) is None
    assert await snapshot(store) == {}


async def test_closing_an_operation_without_a_switch_needs_the_driver_role(
    store: GroupStore,
) -> None:
    await enqueue(store, await open_session(store, "b"))
    requested = await store.request_operation(_op(), retention=60)
    assert requested is not None
    outcome = dataclasses.replace(requested.record, state=OperationState.FAILED, error="held")
    auth = await driver(store)
    stranger = dataclasses.replace(auth, lease=auth.lease + 1)
    assert await store.finish_operation(stranger, requested, outcome) is None
    assert await store.finish_operation(auth, requested, outcome) is not None
    # The record as read is gone: a second close of the same copy fails.
    assert await store.finish_operation(auth, requested, outcome) is None
    assert _read(await snapshot(store), requested.record).error == "held"
