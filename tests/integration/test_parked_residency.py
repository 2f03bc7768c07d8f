"""What an agent's hello says of the jobs parked on its node, written to the group's residency
against a real etcd (issue 37, 8: a job parked on a node that cannot restore it is held back,
so the group must know what is parked where, and stop counting what is not)."""

from __future__ import annotations

from tests.integration.groupstore import snapshot
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.records import ResidentRecord


async def _residency(store: GroupStore) -> ResidentRecord:
    return ResidentRecord.decode((await snapshot(store))["groups/g/resident"].value)


async def test_a_job_reported_off_the_devices_is_parked_there(store: GroupStore) -> None:
    assert not await store.forget_residency("g", "n0", "a", parked=True)  # never granted
    await store.etcd.put(store.keys.resident("g"), ResidentRecord({"n0": ["a", "b"]}).encode())
    assert await store.forget_residency("g", "n0", "a", parked=True)
    assert await _residency(store) == ResidentRecord({"n0": ["b"]}, {"n0": ["a"]})
    assert not await store.forget_residency("g", "n0", "a", parked=True)  # said already
    # Its workers there left: nothing of it is on the node any more.
    assert await store.forget_residency("g", "n0", "a")
    assert await _residency(store) == ResidentRecord({"n0": ["b"]})


async def test_a_hello_settles_what_is_parked_on_its_node(store: GroupStore) -> None:
    assert not await store.settle_parked("g", "n0", ["a"])  # never granted: nothing parked
    record = ResidentRecord({"n0": ["c"], "n1": ["a"]}, {"n0": ["a", "b"], "n1": ["b"]})
    await store.etcd.put(store.keys.resident("g"), record.encode())
    # The agent reports b parked, a not at all (its workers are gone), c on its devices.
    assert await store.settle_parked("g", "n0", ["b", "c"])
    assert await _residency(store) == ResidentRecord(
        {"n0": ["c"], "n1": ["a"]}, {"n0": ["b"], "n1": ["b"]}
    )
    assert not await store.settle_parked("g", "n0", ["b"])  # nothing to change: no write
    assert await store.settle_parked("g", "n0", [])
    assert await _residency(store) == ResidentRecord({"n0": ["c"], "n1": ["a"]}, {"n1": ["b"]})


async def test_a_fence_keeps_what_is_parked_on_the_node(store: GroupStore) -> None:
    record = ResidentRecord({"n0": ["b"]}, {"n0": ["a"]})
    await store.etcd.put(store.keys.resident("g"), record.encode())
    # The fence marks the node's residency unknown: what is on its devices, not what the
    # group parked there (a stays held back until the node has restored it).
    assert await store.set_node_residency("g", "n0", [], "node n0 fenced out")
    assert await _residency(store) == ResidentRecord({}, {"n0": ["a"]})
    # Its hello after the fence: b on its devices, a still parked.
    assert await store.set_node_residency("g", "n0", ["b"])
    assert await _residency(store) == ResidentRecord({"n0": ["b"]}, {"n0": ["a"]})
    # A hello that says a is on its devices settles that it is not parked there.
    assert await store.set_node_residency("g", "n0", ["a"])
    assert await _residency(store) == ResidentRecord({"n0": ["a"]})
