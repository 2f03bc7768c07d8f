"""The state file's writability (timeslice_agent.durability): a failed write says so once, is
counted, and is retried in the background until one succeeds, which says so once; a stopping
agent's last write is not retried. The failure is real: the state file's path is a directory,
so the atomic rename over it fails as a full or read-only disk's write would."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from timeslice_agent.durability import Durability
from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.statefile import AgentState, load_state
from timeslice_agent.tasks import Supervisor


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "state.json"
        self.metrics = AgentMetrics(node="n1", backend="sim", emulated=True)
        self.supervisor = Supervisor(self.metrics)
        self.durability = Durability(
            self.path, lambda: AgentState(node="n1", epochs={"g": 4}), self.metrics, self.supervisor
        )
        self.told: list[str] = []
        self.writable = asyncio.Event()
        self.durability.on_unwritable = lambda reason: self.told.append(reason)
        self.durability.on_writable = self.writable.set

    def block(self) -> None:
        """Make the state file unwritable: a non-empty directory where the file goes."""
        (self.path / "in-the-way").mkdir(parents=True)

    def failures(self) -> float:
        value = self.metrics.registry.get_sample_value("timeslice_agent_state_write_failures_total")
        return value or 0.0

    async def stop(self) -> None:
        tasks = self.supervisor.running()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_write_that_works_leaves_the_state_on_disk(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    assert await rig.durability.persist()
    assert rig.durability.unwritable is None
    state = load_state(rig.path, "n1")
    assert state is not None and state.epochs == {"g": 4}
    assert not rig.told and rig.failures() == 0


async def test_an_unwritable_file_is_told_once_retried_and_rejoins(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.block()
    try:
        assert not await rig.durability.persist()
        error = await rig.durability.save()
        assert error is not None
        assert rig.durability.unwritable is not None
        assert len(rig.told) == 1, "the link is told once, not per failed write"
        assert rig.failures() == 2
        assert [t.get_name() for t in rig.supervisor.running("persist")] == ["state-retry"]
        shutil.rmtree(rig.path)  # the disk has room again
        # The retry runs at most every 2 s: it finds out on its own.
        await asyncio.wait_for(rig.writable.wait(), 15)
        assert rig.durability.unwritable is None
        assert load_state(rig.path, "n1") is not None
        async with asyncio.timeout(5):  # the retry ends once a write succeeded
            while rig.supervisor.running("persist"):
                await asyncio.sleep(0.01)
    finally:
        await rig.stop()


async def test_a_stopping_agents_last_write_is_not_retried(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.block()
    rig.durability.closing = True
    try:
        assert not await rig.durability.persist()
        assert rig.durability.unwritable is not None and len(rig.told) == 1
        assert not rig.supervisor.running("persist")
    finally:
        await rig.stop()
