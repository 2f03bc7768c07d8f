"""A directive relayed to another replica's agent stream ends at once when the agent reconnects.

The replica holding the stream fails whatever was in flight on it when the agent reconnects
(to it, or to another replica), and it never forwards that post again. The driver must then
send the directive anew, as it does for a stream it holds itself, not wait out the directive
deadline (the soak saw 30 s stalls from this).

In process: this replica's router (real mirror, real hub holding no streams, so every
directive goes through etcd) and the other replica's side written into etcd as it would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable

import pytest

from timeslice_orchestrator.hub import AgentHub, AgentUnavailable
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.relay import DirectiveRouter
from timeslice_orchestrator.store.cache import Mirror
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.records import AgentRecord
from timeslice_orchestrator.store.relay import RelayStore
from timeslice_proto.timeslice.v1 import Directive, DirectiveKind

TIMEOUT = 20.0  # the directive's deadline: the test must end far sooner


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    "replica_after", ["r-other", "r-third"], ids=["same-replica", "another-replica"]
)
async def test_a_relayed_directive_fails_fast_when_its_agent_reconnects(
    store: GroupStore, replica_after: str
) -> None:
    mirror = Mirror(store.etcd, store.keys)
    watching = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        hub = AgentHub(store, "r-here", 30, Metrics(), 4.0)
        lease = await store.etcd.grant_lease(30)
        router = DirectiveRouter(hub, mirror, RelayStore(store.etcd, store.keys), "r-here", lease)
        agent_lease = await store.etcd.grant_lease(30)
        first = AgentRecord("node-1", "r-other", "sim", True, connected_at=time.time())
        await store.publish_agent(first, agent_lease)
        await _until(lambda: "node-1" in mirror.agents())

        directive = Directive(
            directive_id="d1", kind=DirectiveKind.CHECKPOINT, group_id="g", job_id="a", epoch=7
        )
        started = time.monotonic()
        sending = asyncio.create_task(router.execute("node-1", directive, TIMEOUT))
        await _until(lambda: mirror.relay("node-1", "d1") is not None)

        # The agent drops its stream and says hello again: a new record, new connection time.
        again = dataclasses.replace(first, replica=replica_after, connected_at=time.time() + 1)
        await store.publish_agent(again, agent_lease)

        with pytest.raises(AgentUnavailable):
            await asyncio.wait_for(sending, TIMEOUT / 2)
        assert time.monotonic() - started < 5.0
        # The post is withdrawn, so the driver can send the same directive id again.
        await _until(lambda: mirror.relay("node-1", "d1") is None)
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
