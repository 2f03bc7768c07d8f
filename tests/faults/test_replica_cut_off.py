"""A waiter whose replica is cut off from etcd never hears of its grant: a known bug, open.

A waiter waits on its replica's copy of etcd. When that replica can no longer reach etcd (a
network partition) while its clients still reach it, a grant made by another replica never
shows in its copy: the client, whose stream stays up (the replica answers its pings), hears
nothing while its hold blocks the group, until the partition heals or its session ends.

Two fixes were tried and taken back (see the stop note of 2026-12-02):

- The replica ends its waiters' streams when it loses its lease. In a quorum loss every
  replica does, the clients cannot re-attach anywhere, and after a session TTL they give up:
  waiters lose their places (``tests/faults/test_etcd_ha.py::
  test_quorum_lost_then_back_keeps_hold_and_queue`` catches it).
- The client moves its wait when a call fails on its replica and works on another. Moving
  resets the old stream, and the old replica, when it can reach etcd again, withdraws the
  entry before the new replica re-stamps it: the waiter lands at the back of the queue.

A fix must re-attach on the new replica before the old stream is reset (and a hand-back of an
undelivered grant must compare the attempt that holds it). Until then this test fails, and
is kept, strictly expected to fail, as the reproduction.

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

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xfail(
        strict=True, raises=TimeoutError, reason="known bug: see the module docstring"
    ),
]

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
                # Expected: the wait moves to r1 (see the module docstring).
                grant = await asyncio.wait_for(waiter, 15)
                assert grant.epoch == granted.holder_epoch > first.epoch
                await b.yield_(GROUP)
                again = await a.acquire(GROUP, timeout=10)
                await a.yield_(GROUP)
                assert again.epoch > grant.epoch
        finally:
            etcd.release()
