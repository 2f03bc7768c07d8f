"""An agent's older stream cannot undo what its newer stream published.

An agent that reconnects (to another replica, or to the same one) publishes its whole worker
set with its new hello. A worker change the old stream was still writing could land after
that and put back an older worker set: planned without a worker, a switch would leave its
state on the devices beside the next job's. Each stream's later writes therefore compare
the record's revision with the stream's own last write.

In process: two real hubs (two replicas) on one real etcd, driven the way the generated
service drives them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from timeslice.errors import FailedPrecondition
from timeslice_orchestrator.hub import AgentHub
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.records import AgentRecord
from timeslice_proto.timeslice.v1 import (
    AgentHello,
    AgentMessage,
    OrchestratorMessage,
    WorkerInfo,
    WorkersChanged,
)

NODE = "node-1"


def _worker(job: str) -> WorkerInfo:
    return WorkerInfo(job_id=job, group_id="g", pid=100, state_bytes=1)


async def _recorded_jobs(store: GroupStore) -> list[str]:
    kv = await store.etcd.get(store.keys.agent(NODE))
    assert kv is not None
    return sorted(w.job for w in AgentRecord.decode(kv.value).workers)


class _Agent:
    """One stream of the agent to one hub: a hello with ``jobs``, then what it is told to send."""

    def __init__(self, hub: AgentHub, jobs: list[str]) -> None:
        self.to_send: asyncio.Queue[AgentMessage | None] = asyncio.Queue()
        self.received: list[OrchestratorMessage] = []
        hello = AgentHello(
            node=NODE, backend="sim", emulated=True, workers=[_worker(j) for j in jobs]
        )
        self.stream = asyncio.create_task(self._serve(hub, hello))

    async def _messages(self, hello: AgentHello) -> AsyncIterator[AgentMessage]:
        yield AgentMessage(hello=hello)
        while (message := await self.to_send.get()) is not None:
            yield message

    async def _serve(self, hub: AgentHub, hello: AgentHello) -> None:
        # What the generated AgentHub service does with the handler's messages.
        async for message in hub.connect(self._messages(hello)):
            self.received.append(message)

    async def welcomed(self) -> None:
        deadline = time.monotonic() + 10
        while not any(m.welcome is not None for m in self.received):
            assert time.monotonic() < deadline and not self.stream.done(), "never welcomed"
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self.to_send.put_nowait(None)
        self.stream.cancel()
        await asyncio.wait([self.stream])


async def test_a_late_write_of_an_older_stream_does_not_replace_a_newer_ones(
    store: GroupStore,
) -> None:
    first, second = AgentHub(store, "r-a", 30, Metrics()), AgentHub(store, "r-b", 30, Metrics())
    old = _Agent(first, ["a"])
    await old.welcomed()
    new = _Agent(second, ["a", "b"])  # reconnected to the other replica, with b registered
    await new.welcomed()
    assert await _recorded_jobs(store) == ["a", "b"]
    try:
        # A worker change that reached the old stream before the agent moved (b not in it).
        old.to_send.put_nowait(AgentMessage(workers=WorkersChanged(workers=[_worker("a")], seq=1)))
        await asyncio.wait_for(asyncio.shield(old.stream), 10)  # that stream ends
        assert await _recorded_jobs(store) == ["a", "b"]
        assert not any(m.workers_recorded is not None for m in old.received)
        # The newer stream goes on recording changes.
        change = WorkersChanged(workers=[_worker("a"), _worker("b"), _worker("c")], seq=2)
        new.to_send.put_nowait(AgentMessage(workers=change))
        deadline = time.monotonic() + 10
        while not any(m.workers_recorded is not None for m in new.received):
            assert time.monotonic() < deadline, "the newer stream's change was not recorded"
            await asyncio.sleep(0.01)
        assert await _recorded_jobs(store) == ["a", "b", "c"]
    finally:
        await old.close()
        await new.close()


async def test_a_write_after_another_writers_is_refused(store: GroupStore) -> None:
    record = AgentRecord(node=NODE, replica="r-a", backend="sim", emulated=True, connected_at=1.0)
    lease = await store.agent_lease(NODE, 30)
    first = await store.publish_agent(record, lease, fence_revision=0)
    second = await store.publish_agent(record, lease, fence_revision=0, after=first)
    with pytest.raises(FailedPrecondition, match="connected again"):
        await store.publish_agent(record, lease, fence_revision=0, after=first)
    kv = await store.etcd.get(store.keys.agent(NODE))
    assert kv is not None and kv.mod_revision == second
