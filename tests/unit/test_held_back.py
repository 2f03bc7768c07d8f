"""The waiters held back for a node that cannot restore them (``held_back.py``), without a
server: the store's two writes are recorded by a stand-in."""

from __future__ import annotations

from typing import cast

from tests.unit.views import GB, agent, agents, stored, view, waiter
from timeslice_orchestrator.held_back import HeldBack, held_back_note
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.reconcile import DriverConfig, Next, OwnWrites
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import Authority, Fault, GroupStore
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import GroupStats, ResidentRecord


class _Store:
    """What ``HeldBack`` writes: notes in last_error, and faults."""

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.faults: list[Fault] = []

    async def note_error(self, group: str, note: str) -> bool:
        self.notes.append(note)
        return True

    async def fault_waiter(
        self, group: str, auth: Authority, fault: Fault, stats: GroupStats
    ) -> int | None:
        self.faults.append(fault)
        return 2000


def _held_back(store: _Store, parked_wait: float = 30.0) -> tuple[HeldBack, Metrics]:
    metrics = Metrics()
    config = DriverConfig(replica_id="r1", parked_wait=parked_wait)
    writes = OwnWrites(cast(Mirror, None))
    auth = Authority("r1", 7)
    return HeldBack(cast(GroupStore, store), auth, metrics, config, writes), metrics


def _parked(parked: dict[str, list[str]]) -> GroupView:
    group = view([waiter("a", 10), waiter("b", 11)])
    group.resident = stored(ResidentRecord({"n1": []}, parked), 4)
    return group


async def test_nothing_parked_serves_the_first_in_line_and_writes_nothing() -> None:
    store = _Store()
    held_back, _ = _held_back(store)
    group = view([waiter("a", 10), waiter("b", 11)], resident={"n1": ["a"]})
    first = await held_back.first_servable(group, group.queue, agents(agent("n1", {"a": GB})))
    assert first == group.queue[0]
    assert store.notes == [] and len(held_back.ledger) == 0


async def test_a_waiter_parked_on_an_away_node_is_held_back_and_the_next_served() -> None:
    store = _Store()
    held_back, _ = _held_back(store, parked_wait=30.0)
    group = _parked({"n2": ["a"]})  # n2's agent is away
    present = agents(agent("n1", {"a": GB, "b": GB}))
    first = await held_back.first_servable(group, group.queue, present)
    assert first == group.queue[1]
    note = held_back_note("a", ["n2"], 30.0)
    assert store.notes == [note] and group.stats.last_error == note
    assert len(held_back.ledger) == 1
    # Said once: the same note is not written again.
    await held_back.first_servable(group, group.queue, present)
    assert store.notes == [note]
    # n2 is back with a's workers: a is served, and no longer held back.
    back = agents(agent("n1", {"a": GB, "b": GB}), agent("n2", {"a": GB}))
    assert await held_back.first_servable(group, group.queue, back) == group.queue[0]
    assert len(held_back.ledger) == 0


async def test_only_parked_waiters_wait_and_one_past_its_deadline_is_faulted() -> None:
    store = _Store()
    held_back, metrics = _held_back(store, parked_wait=30.0)
    group = _parked({"n2": ["a", "b"]})
    present = agents(agent("n1", {"a": GB, "b": GB}))
    assert await held_back.first_servable(group, group.queue, present) is Next.LATER
    assert store.faults == []
    held_back, metrics = _held_back(store, parked_wait=0.0)
    assert await held_back.first_servable(group, group.queue, present) is Next.AGAIN
    (fault,) = store.faults
    assert fault.waiter == group.queue[0]
    assert "could not restore it for 0 s" in fault.reason
    assert group.stats.faults == 1
    labels = {"outcome": "held_back_too_long"}
    assert metrics.registry.get_sample_value("timeslice_switches_total", labels) == 1
