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

import pytest

from tests.integration.polling import until
from timeslice_orchestrator.hub import AgentHub, AgentUnavailable
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.relay import DirectiveRouter, _encode
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.records import AgentRecord, RelayRecord
from timeslice_orchestrator.store.relay import RelayStore
from timeslice_proto.timeslice.v1 import AckStatus, Directive, DirectiveAck, DirectiveKind

TIMEOUT = 20.0  # the directive's deadline: the test must end far sooner


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
        await store.publish_agent(first, agent_lease, fence_revision=0)
        await until(lambda: "node-1" in mirror.agents())

        directive = Directive(
            directive_id="d1", kind=DirectiveKind.CHECKPOINT, group_id="g", job_id="a", epoch=7
        )
        started = time.monotonic()
        sending = asyncio.create_task(router.execute("node-1", directive, TIMEOUT))
        await until(lambda: mirror.relay("node-1", "d1") is not None)

        # The agent drops its stream and says hello again: a new record, new connection time.
        again = dataclasses.replace(first, replica=replica_after, connected_at=time.time() + 1)
        await store.publish_agent(again, agent_lease, fence_revision=0)

        with pytest.raises(AgentUnavailable):
            await asyncio.wait_for(sending, TIMEOUT / 2)
        assert time.monotonic() - started < 5.0
        # The post is withdrawn, so the driver can send the same directive id again.
        await until(lambda: mirror.relay("node-1", "d1") is None)
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching


async def test_a_directive_posted_already_is_joined_and_reposted_if_withdrawn(
    store: GroupStore,
) -> None:
    """A send of a directive whose earlier send is still posted (that pass was cut short by an
    etcd outage, its post left behind) waits for that post's ack instead of failing (which
    rolled the switch back while the checkpoint still ran); a post withdrawn unanswered is
    posted again."""
    mirror = Mirror(store.etcd, store.keys)
    watching = asyncio.create_task(mirror.run())
    try:
        await asyncio.wait_for(mirror.synced.wait(), 10)
        hub = AgentHub(store, "r-here", 30, Metrics(), 4.0)
        lease = await store.etcd.grant_lease(30)
        relay = RelayStore(store.etcd, store.keys)
        router = DirectiveRouter(hub, mirror, relay, "r-here", lease)
        agent_lease = await store.etcd.grant_lease(30)
        agent = AgentRecord("node-1", "r-other", "sim", True, connected_at=time.time())
        await store.publish_agent(agent, agent_lease, fence_revision=0)
        await until(lambda: "node-1" in mirror.agents())
        directive = Directive(
            directive_id="d2", kind=DirectiveKind.CHECKPOINT, group_id="g", job_id="a", epoch=9
        )
        # The earlier send's post, left in etcd.
        earlier = RelayRecord(driver="r-here", directive=_encode(directive))
        assert await relay.post("node-1", "d2", earlier, lease)
        await until(lambda: mirror.relay("node-1", "d2") is not None)
        first = mirror.relay("node-1", "d2")
        assert first is not None

        sending = asyncio.create_task(router.execute("node-1", directive, TIMEOUT))
        await asyncio.sleep(0.3)
        assert not sending.done(), "joined the post, not refused"
        # The earlier send gives up and withdraws it: this send posts it again.
        await relay.remove("node-1", "d2")

        def reposted() -> bool:
            # Not the earlier post, which the mirror may still show (on a loaded machine
            # its deletion can arrive after this line runs).
            shown = mirror.relay("node-1", "d2")
            return shown is not None and shown.create_revision > first.create_revision

        await until(reposted, timeout=5)
        # The other replica forwards it and attaches the agent's ack.
        posted = mirror.relay("node-1", "d2")
        assert posted is not None
        ack = DirectiveAck(directive_id="d2", status=AckStatus.OK, bytes_moved=5)
        assert await relay.answer("node-1", "d2", posted, _encode(ack))
        got = await asyncio.wait_for(sending, 10)
        assert (got.directive_id, got.status, got.bytes_moved) == ("d2", AckStatus.OK, 5)
    finally:
        watching.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watching
