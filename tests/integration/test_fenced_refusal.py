"""The orchestrator tells a fenced node's refusal by its typed cause, never by its wording.

An agent fenced out at a revision above a switch's epoch refuses the switch's directives
STALE_EPOCH with ``stale_cause`` NODE_FENCED: the switch goes on without the node (its result
is ``gone`` and ``fenced``). A STALE_EPOCH for the group's own newer epoch is a plain refusal,
whatever its error text says: the text is for people, and any agent may word it its own way.

In process: a real hub and router on a real etcd, the directive sender the driver uses, and a
scripted agent stream whose acks go through their wire encoding.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from opentelemetry.trace import NoOpTracer

from tests.integration.polling import until
from timeslice_orchestrator.directives import DirectiveSender
from timeslice_orchestrator.hub import AgentHub
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.relay import DirectiveRouter
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.records import NodeStep, Stored, SwitchPhase, SwitchRecord
from timeslice_orchestrator.store.relay import RelayStore
from timeslice_proto.timeslice.v1 import (
    AckStatus,
    AgentHello,
    AgentMessage,
    DirectiveAck,
    DirectiveKind,
    StaleCause,
    WorkerInfo,
)

NODE = "node-1"
EPOCH = 7


class ScriptedAgent:
    """The node's agent stream: answers every directive with ``status``, ``cause``, ``error``."""

    def __init__(self, hub: AgentHub, status: AckStatus, cause: StaleCause, error: str) -> None:
        self._status, self._cause, self._error = status, cause, error
        self.outbox: asyncio.Queue[AgentMessage | None] = asyncio.Queue()
        hello = AgentHello(
            node=NODE,
            backend="sim",
            emulated=True,
            workers=[WorkerInfo(job_id="a", group_id="g", pid=1)],
        )
        self.outbox.put_nowait(AgentMessage(hello=hello))
        self.welcomed = asyncio.Event()
        self.stream = asyncio.create_task(self._serve(hub))

    async def _messages(self) -> AsyncIterator[AgentMessage]:
        while (message := await self.outbox.get()) is not None:
            yield message

    async def _serve(self, hub: AgentHub) -> None:
        async for message in hub.connect(self._messages()):
            if message.welcome is not None:
                self.welcomed.set()
            d = message.directive
            if d is None:
                continue
            ack = DirectiveAck(
                directive_id=d.directive_id,
                group_id=d.group_id,
                epoch=d.epoch,
                status=self._status,
                stale_cause=self._cause,
                error=self._error,
            )
            # As it crosses the wire: the cause must survive the encoding.
            self.outbox.put_nowait(AgentMessage(ack=DirectiveAck.parse(bytes(ack))))

    async def hang_up(self) -> None:
        self.outbox.put_nowait(None)
        self.stream.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.stream


@pytest.mark.parametrize(
    ("cause", "error", "fenced"),
    [
        # A fenced refusal worded in a way no orchestrator has seen: still fenced.
        (StaleCause.NODE_FENCED, "refusé: nœud clôturé", True),
        # The wording agents used for a fenced refusal, with the group's own cause: not fenced.
        (
            StaleCause.GROUP_EPOCH,
            f"stale epoch {EPOCH}: this node was fenced out at revision 9",
            False,
        ),
    ],
    ids=["fenced-any-wording", "group-epoch-fence-wording"],
)
async def test_a_fenced_refusal_is_read_from_its_typed_cause(
    store: GroupStore, cause: StaleCause, error: str, fenced: bool
) -> None:
    mirror = Mirror(store.etcd, store.keys)
    watching = asyncio.create_task(mirror.run())
    agent: ScriptedAgent | None = None
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        hub = AgentHub(store, "r-here", 30, Metrics())
        lease = await store.etcd.grant_lease(30)
        router = DirectiveRouter(hub, mirror, RelayStore(store.etcd, store.keys), "r-here", lease)
        sender = DirectiveSender(router, mirror, Metrics(), NoOpTracer(), timeout=5.0)
        agent = ScriptedAgent(hub, AckStatus.STALE_EPOCH, cause, error)
        await asyncio.wait_for(agent.welcomed.wait(), 10)
        await until(lambda: hub.holds(NODE))

        step = NodeStep(node=NODE, evict="a", restore="b")
        switch = SwitchRecord(
            switch_id="s1",
            group="g",
            to_job="b",
            to_revision=EPOCH,
            steps=[step],
            phase=SwitchPhase.CHECKPOINT,
            driver="r-here",
            started_at=time.time(),
        )
        stored = Stored(switch, create_revision=EPOCH, mod_revision=EPOCH, lease=0)
        [result] = await sender.fan_out(stored, DirectiveKind.CHECKPOINT, [step], "evict")

        assert not result.ok
        assert result.fenced is fenced
        assert result.gone is fenced
        assert result.failed is not fenced
        assert error in result.error
    finally:
        if agent is not None:
            await agent.hang_up()
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
