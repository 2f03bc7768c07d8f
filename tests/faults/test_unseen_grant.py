"""A grant still on the wire when its acquire is aborted goes back; it does not block the group.

Aborting an acquire (a cancel, its timeout) resets the Acquire stream, and the server takes
back a grant it could not deliver. But when the server had already sent GRANTED and ended
its stream, the reset arrives too late for it, and the client drops the GRANTED that arrives
after its reset. The hold then sat on the client's live session with no record in the
client: nobody else was granted the group until the job exited, and the job's own next
acquire was refused ("already holds"). The client now looks the group up after an abort and
gives back a hold of its own that it has no grant for.

How the GRANTED is kept on the wire: the waiter reaches the replica through a TCP proxy that
holds the bytes coming from the server while the grant is made and the stream ends.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.conftest import ClusterFactory
from tests.faults.harness import wait_for_status
from tests.faults.proxy import HoldingProxy
from timeslice import AcquireStage, AsyncTimeSliceClient
from timeslice.errors import Timeout

pytestmark = pytest.mark.slow

GROUP = "g"


async def test_a_grant_on_the_wire_when_its_acquire_is_aborted_is_given_back(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(replicas=1, agents=0)
    (replica,) = cluster.targets
    async with (
        HoldingProxy(replica).running() as proxy,
        AsyncTimeSliceClient([replica], job_id="a") as a,
        AsyncTimeSliceClient([proxy.target], job_id="b") as b,
        AsyncTimeSliceClient([replica], job_id="observer") as observer,
    ):
        first = await a.acquire(GROUP, timeout=30)
        waiter = asyncio.create_task(b.acquire(GROUP))
        await wait_for_status(observer, GROUP, lambda s: [q.job_id for q in s.queue] == ["b"], 10)

        proxy.hold()
        await a.yield_(GROUP)  # hands the group over to b: GRANTED goes out, into the proxy
        granted = await wait_for_status(observer, GROUP, lambda s: s.holder_job_id == "b", 10)
        assert granted.holder_epoch > first.epoch
        await asyncio.sleep(0.3)  # the replica ends b's stream; that too waits in the proxy
        assert not waiter.done()
        waiter.cancel()  # the reset reaches the replica after its stream ended
        with pytest.raises(asyncio.CancelledError):
            await waiter
        proxy.release()  # the GRANTED arrives for a stream the client has reset

        # The client finds the hold it has no grant for and gives it back; its next acquire
        # of the group, at once, waits for that instead of meeting the hold ("already holds").
        again = await asyncio.wait_for(b.acquire(GROUP, timeout=10), 15)
        assert again.epoch > granted.holder_epoch
        status = await observer.status(GROUP)
        assert (status.holder_job_id, status.holder_epoch) == ("b", again.epoch)
        await b.yield_(GROUP)
        after = await a.acquire(GROUP, timeout=10)
        await a.yield_(GROUP)
        assert after.epoch > again.epoch


async def test_a_queue_entry_left_by_an_aborted_acquire_is_taken_back(
    cluster_factory: ClusterFactory,
) -> None:
    """The acquire is aborted while no stream is open (its replica died, the other one is
    paused): nobody withdraws its entry, which would be granted later to a job that has
    no record of it. The client takes it back once a replica answers."""
    cluster = cluster_factory(replicas=2, agents=0, replica_ttl=2)
    r0, r1 = cluster.targets
    paused = cluster.services["r1"].pid
    assert paused is not None
    async with (
        AsyncTimeSliceClient([r1], job_id="a") as a,
        AsyncTimeSliceClient([r0, r1], job_id="b") as b,  # its stream goes to r0
        AsyncTimeSliceClient([r1], job_id="observer") as observer,
    ):
        first = await a.acquire(GROUP, timeout=30)
        queued = asyncio.Event()
        waiter = asyncio.create_task(
            b.acquire(
                GROUP,
                timeout=3,
                on_progress=lambda p: queued.set() if p.state is AcquireStage.QUEUED else None,
            )
        )
        # b itself must know it is queued: the observer can see the entry in etcd before the
        # QUEUED event reaches b, and an acquire that never heard from a replica ends as
        # ReplicasUnreachable, not Timeout (tests/sdk/test_connection_errors.py).
        async with asyncio.timeout(10):
            await queued.wait()
        await wait_for_status(observer, GROUP, lambda s: [q.job_id for q in s.queue] == ["b"], 10)
        os.kill(paused, signal.SIGSTOP)
        try:
            cluster.kill_replica(0)
            with pytest.raises(Timeout):
                await asyncio.wait_for(waiter, 10)
        finally:
            os.kill(paused, signal.SIGCONT)

        await wait_for_status(observer, GROUP, lambda s: not s.queue, 15)
        await a.yield_(GROUP)
        # Free, not granted to b, which gave up (the observer's replica sees the release a
        # moment after the yield returns; a grant to b would keep it held).
        await wait_for_status(observer, GROUP, lambda s: not s.holder_job_id, 15)
        again = await b.acquire(GROUP, timeout=10)  # not refused: "already holds"
        assert again.epoch > first.epoch
        await b.yield_(GROUP)
