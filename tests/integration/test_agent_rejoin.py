"""A node rejoins its groups (its agent record is published) only once its residency is the truth.

Between an agent record showing up and the residency being settled, a driver can plan a switch
with the node and no residency there: nothing to evict, the next holder restored onto devices
that still hold another job's state. So whatever the agent's hello says about its devices is
written before the record is published: after a fence (the reconcile), and after its agent
lease ran out (the settle). And a fence that fails halfway must still end the node's session,
or the replica holding its stream re-publishes the record on the live lease, a rejoin with
neither the reconcile nor the fence revision.

In process: real hubs on a real etcd, and a mirror watching what a driver would see.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection

import pytest

from tests.integration.polling import until
from timeslice_orchestrator.hub import AgentHub
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.store.etcd import EtcdClient, LeaseExpired, StoreUnavailable
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.mirror import AGENTS_TOPIC
from timeslice_orchestrator.store.records import ResidentRecord
from timeslice_proto.timeslice.v1 import (
    AgentHello,
    AgentMessage,
    JobReport,
    JobState,
    OrchestratorMessage,
    WorkerInfo,
    WorkersChanged,
)
from timeslice_tools.dev.etcd import EtcdServer

NODE = "node-1"
# Short, so that the replica holding a stream notices a revoked lease within a second.
AGENT_TTL = 3


class Agent:
    """One stream of the node's agent into ``hub``: what it says, and what it is told."""

    def __init__(self, hub: AgentHub, hello: AgentHello) -> None:
        self.outbox: asyncio.Queue[AgentMessage | None] = asyncio.Queue()
        self.outbox.put_nowait(AgentMessage(hello=hello))
        self.told: list[OrchestratorMessage] = []
        self.stream = asyncio.create_task(self._serve(hub))

    async def _messages(self) -> AsyncIterator[AgentMessage]:
        while (message := await self.outbox.get()) is not None:
            yield message

    async def _serve(self, hub: AgentHub) -> None:
        # What the generated AgentHub service does with the handler's messages.
        async for message in hub.connect(self._messages()):
            self.told.append(message)

    async def welcomed(self) -> int:
        """The fence revision its Welcome told it."""
        await until(lambda: bool(self.told) or self.stream.done())
        welcome = self.told[0].welcome
        assert welcome is not None
        return welcome.fence_revision

    async def hang_up(self) -> None:
        self.outbox.put_nowait(None)
        self.stream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.stream


def _hello(jobs: dict[str, JobState], fence_revision: int = 0) -> AgentHello:
    """The node's hello: a worker of each job in group g, and each job's state there."""
    return AgentHello(
        node=NODE,
        backend="sim",
        emulated=True,
        workers=[WorkerInfo(job_id=job, group_id="g", pid=1) for job in jobs],
        jobs=[JobReport(job_id=job, group_id="g", state=state) for job, state in jobs.items()],
        fence_revision=fence_revision,
    )


@contextlib.asynccontextmanager
async def _mirror(store: GroupStore) -> AsyncIterator[tuple[Mirror, list[list[str] | None]]]:
    """A mirror of the store, and what it showed as the node's residency in g at each batch
    that showed the node's agent record (None: no residency there)."""
    mirror = Mirror(store.etcd, store.keys)
    shown: list[list[str] | None] = []

    def on_change(topics: set[str]) -> None:
        if AGENTS_TOPIC in topics and NODE in mirror.agents():
            shown.append(mirror.group("g").residency().nodes.get(NODE))

    mirror.add_listener(on_change)
    watching = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        yield mirror, shown
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching


async def _group_g(store: GroupStore, resident: dict[str, list[str]]) -> None:
    await store.etcd.put(store.keys.meta("g"), b"{}")
    await store.etcd.put(store.keys.resident("g"), ResidentRecord(resident).encode())


async def test_a_fence_that_fails_to_mark_residency_still_ends_the_nodes_session(
    etcd_server: EtcdServer, store: GroupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _group_g(store, {"node-0": ["b"], NODE: ["a", "c"]})
    async with _mirror(store) as (mirror, shown):
        holder = AgentHub(store, "r-holder", AGENT_TTL, Metrics())
        first = Agent(holder, _hello({"a": JobState.IDLE, "c": JobState.IDLE}))
        assert await first.welcomed() == 0
        await until(lambda: NODE in mirror.agents())
        kv = await store.etcd.get(store.keys.agent(NODE))
        assert kv is not None and kv.lease
        lease = kv.lease

        # Another replica fences the node (a missed deadline); marking its residency unknown
        # fails (etcd away for a moment, or the group's stats changing under every attempt).
        etcd = EtcdClient([etcd_server.endpoint])
        try:
            fencer_store = GroupStore(etcd, store.keys)

            async def unavailable(*args: object, **kwargs: object) -> bool:
                raise StoreUnavailable("etcd went away (injected)")

            monkeypatch.setattr(fencer_store, "set_node_residency", unavailable)
            fencer = AgentHub(fencer_store, "r-fencer", AGENT_TTL, Metrics())
            with pytest.raises(StoreUnavailable):
                await fencer.fence(NODE, "missed a deadline", ["g"])
        finally:
            await etcd.close()
        fence = await store.fence_of(NODE)
        assert fence is not None
        await until(lambda: NODE not in mirror.agents())
        shown.clear()

        # The node's session is over all the same: its agent lease is gone, so the replica
        # holding its stream ends it, and a change of its workers is not published on it.
        with pytest.raises(LeaseExpired):
            await store.etcd.keepalive_once(lease)
        workers = [WorkerInfo(job_id=job, group_id="g", pid=1) for job in ("a", "c", "d")]
        first.outbox.put_nowait(AgentMessage(workers=WorkersChanged(workers=workers)))
        await asyncio.wait_for(asyncio.shield(first.stream), AGENT_TTL + 5)
        assert not holder.holds(NODE)
        assert NODE not in mirror.agents() and shown == []

        # Its next hello (below the fence) reconciles, before the node is published again.
        # The residency the fence could not mark still lists c, which the node parked since.
        second = Agent(holder, _hello({"a": JobState.IDLE, "c": JobState.SAVED}))
        assert await second.welcomed() == fence.mod_revision
        await until(lambda: bool(shown))
        assert shown[0] == ["a"]
        await second.hang_up()
        await first.hang_up()


async def test_an_agent_back_after_its_lease_ran_out_is_published_with_its_residency(
    store: GroupStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The node's agent lease ran out while the group went on: its residency lacks the node,
    # whose devices still hold a's state.
    await _group_g(store, {"node-0": ["b"]})
    async with _mirror(store) as (mirror, shown):
        settle = store.settle_unknown_residency

        async def settle_once_seen(
            group: str, node: str, on_device: list[str], **more: Collection[str]
        ) -> bool:
            # A quick driver: were the record published already, the mirror (and so a
            # driver) shows it before the residency is settled.
            published = await store.etcd.get(store.keys.agent(node))
            if published is not None:
                await mirror.wait_for_revision(published.mod_revision, 10)
            return await settle(group, node, on_device, **more)

        monkeypatch.setattr(store, "settle_unknown_residency", settle_once_seen)
        hub = AgentHub(store, "r-here", 30, Metrics())
        agent = Agent(hub, _hello({"a": JobState.IDLE}))
        assert await agent.welcomed() == 0
        await until(lambda: bool(shown))
        assert shown[0] == ["a"], "the record was published before the residency was settled"
        await agent.hang_up()
