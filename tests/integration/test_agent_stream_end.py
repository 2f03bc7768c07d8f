"""A replica lets go of an agent's stream at once when the stream's connection is lost.

grpclib cancels the handler of a lost connection twice (its stream wrapper and its handler
both do), the second time while the handler is already cleaning up. The hub must still fail
what was in flight on the stream and stop counting the node as connected here: otherwise
directives go into a dead stream and wait out their deadlines (the soak saw switches of 31 s
after an agent paused for 2.6 s and dropped its stream).

In process: a real hub on a real etcd, driven the way the generated service drives it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from timeslice_orchestrator.hub import AgentHub, AgentUnavailable
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_proto.timeslice.v1 import (
    AgentHello,
    AgentMessage,
    Directive,
    DirectiveKind,
    OrchestratorMessage,
)


async def _agent(hung_up: asyncio.Event) -> AsyncIterator[AgentMessage]:
    """An agent that says hello, then stays silent until the connection goes."""
    yield AgentMessage(hello=AgentHello(node="node-1", backend="sim", emulated=True))
    await hung_up.wait()


@pytest.mark.parametrize("cancels", [1, 2])
async def test_a_lost_stream_fails_its_directives_and_is_let_go_of(
    store: GroupStore, cancels: int
) -> None:
    hub = AgentHub(store, "r-here", 30, Metrics())
    sent: list[OrchestratorMessage] = []
    hung_up = asyncio.Event()

    async def serve() -> None:
        # What the generated AgentHub service does with the handler's messages.
        async for message in hub.connect(_agent(hung_up)):
            sent.append(message)

    stream = asyncio.create_task(serve())
    deadline = time.monotonic() + 10
    while not (hub.holds("node-1") and sent):
        assert time.monotonic() < deadline and not stream.done(), "the agent never got in"
        await asyncio.sleep(0.01)
    directive = Directive(
        directive_id="d1", kind=DirectiveKind.RESTORE, group_id="g", job_id="a", epoch=7
    )
    pending = asyncio.create_task(hub.execute("node-1", directive, 20.0))
    while len(sent) < 2:
        assert time.monotonic() < deadline, "the directive never went out"
        await asyncio.sleep(0.01)

    started = time.monotonic()
    # The connection is lost: the handler is cancelled, and again while it cleans up.
    for _ in range(cancels):
        stream.cancel()
        for _ in range(3):
            await asyncio.sleep(0)
    hung_up.set()
    # What was in flight fails, and the node is let go of, at once: before the handler's
    # own clean-up ends (that waits up to 5 s for its tasks, which a loaded machine used).
    with pytest.raises(AgentUnavailable):
        await asyncio.wait_for(pending, 5.0)
    assert time.monotonic() - started < 2.0
    assert not hub.holds("node-1")
    with pytest.raises(asyncio.CancelledError):
        await stream
    with pytest.raises(AgentUnavailable):
        await hub.execute("node-1", directive, 20.0)
