"""Every replica restarted in turn: holds, queue places and agent registrations survive."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import ClusterFactory
from tests.faults.harness import wait_for_status
from timeslice import AsyncTimeSliceClient, register

pytestmark = pytest.mark.slow


async def test_rolling_restart_keeps_holds_queues_and_agents(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(replicas=3, agents=2, replica_ttl=2)
    sockets = [str(p) for p in cluster.agent_sockets.values()]
    workers = [register("g", job_id=j, socket=s) for j in ("h", "w1", "w2") for s in sockets]
    try:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="h") as holder,
            AsyncTimeSliceClient(cluster.targets, job_id="w1") as w1,
            AsyncTimeSliceClient(cluster.targets, job_id="w2") as w2,
            AsyncTimeSliceClient(cluster.targets, job_id="observer") as observer,
        ):
            grant = await holder.acquire("g", timeout=30)
            first = asyncio.create_task(w1.acquire("g", timeout=120))
            await wait_for_status(observer, "g", lambda s: len(s.queue) == 1, 10)
            second = asyncio.create_task(w2.acquire("g", timeout=120))
            before = await wait_for_status(observer, "g", lambda s: len(s.queue) == 2, 10)
            tickets = [(q.job_id, q.revision) for q in before.queue]

            for index in range(3):
                cluster.stop_replica(index)
                await asyncio.to_thread(cluster.start_replica, index)

            after = await wait_for_status(
                observer,
                "g",
                lambda s: {n.node for n in s.nodes} == {"node-0", "node-1"},
                15,
            )
            assert after.holder_job_id == "h" and after.holder_epoch == grant.epoch
            assert [(q.job_id, q.revision) for q in after.queue] == tickets
            await holder.yield_("g")  # the hold and its epoch are still valid
            g1 = await first
            await w1.yield_("g")
            g2 = await second
            assert (g1.job_id, g2.job_id) == ("w1", "w2")
            assert grant.epoch < g1.epoch < g2.epoch
            await w2.yield_("g")
    finally:
        for w in workers:
            w.close()
