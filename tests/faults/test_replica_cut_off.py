"""A waiter whose replica is cut off from etcd moves to a replica that can tell it of its grant.

A waiter waits on its replica's copy of etcd. When that replica can no longer reach etcd (a
network partition) while its clients still reach it, a grant made by another replica never
shows in its copy: the client, whose stream stays up (the replica answers its pings), heard
nothing while its hold blocked the group, until the partition healed or its session ended.

Now a call of the client (its session keepalive) that fails on that replica and works on
another moves the wait there: the same request re-attaches to its place, and only then is
the old stream reset (the old replica, reaching etcd again, would otherwise withdraw the
entry first, or give back the grant it could not deliver). A failure everywhere (etcd itself
away) moves nothing: ``tests/faults/test_etcd_ha.py::
test_quorum_lost_then_back_keeps_hold_and_queue`` keeps every place through a quorum loss.

The partition: replica r0 reaches etcd through a TCP proxy that the test holds.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import ClusterFactory
from tests.faults.harness import wait_for_status
from tests.faults.proxy import HoldingProxy
from timeslice import AsyncTimeSliceClient
from timeslice_tools.dev.cluster import ServiceProcess

pytestmark = pytest.mark.slow

GROUP = "g"


async def test_a_waiter_on_a_replica_cut_off_from_etcd_gets_its_grant_elsewhere(
    cluster_factory: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = cluster_factory(replicas=2, agents=0, replica_ttl=2)
    async with HoldingProxy(cluster.etcd_endpoint).running() as etcd:
        # r0 again, through the proxy (argparse takes the last --etcd).
        cluster.stop_replica(0)
        argv = cluster._argv

        def through_proxy(service: ServiceProcess) -> list[str]:
            out = argv(service)
            return [*out, "--etcd", etcd.target] if service.name == "r0" else out

        monkeypatch.setattr(cluster, "_argv", through_proxy)
        await asyncio.to_thread(cluster.start_replica, 0)
        r0, r1 = cluster.targets
        try:
            async with (
                AsyncTimeSliceClient([r1], job_id="a") as a,
                AsyncTimeSliceClient([r0, r1], job_id="b") as b,  # its stream goes to r0
                AsyncTimeSliceClient([r1], job_id="observer") as observer,
            ):
                first = await a.acquire(GROUP, timeout=30)
                waiter = asyncio.create_task(b.acquire(GROUP, timeout=60))
                await wait_for_status(
                    observer, GROUP, lambda s: [q.job_id for q in s.queue] == ["b"], 10
                )
                etcd.hold(both=True)  # r0 is cut off from etcd; b still reaches r0
                await a.yield_(GROUP)
                granted = await wait_for_status(
                    observer, GROUP, lambda s: s.holder_job_id == "b", 20
                )
                # b's next keepalive fails on r0 and works on r1: the wait moves there.
                grant = await asyncio.wait_for(waiter, 15)
                assert grant.epoch == granted.holder_epoch > first.epoch
                await b.yield_(GROUP)
                again = await a.acquire(GROUP, timeout=10)
                await a.yield_(GROUP)
                assert again.epoch > grant.epoch
        finally:
            etcd.release()
