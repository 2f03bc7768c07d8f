"""A key or record under the prefix that does not decode stops nothing but its own group.

Someone else writes under the deployment's prefix: a tool, a hand with etcdctl, a newer
version. Before, a key that is not UTF-8 made the mirror's watch fail, and a stats record
that does not decode made the dashboard's listener, called from the same watch, fail: the
mirror's task ended, every replica exited, and none could start again (the initial load met
the same keys). Now such a key is not one of ours, and a listener's failure is logged.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import ClusterFactory
from tests.integration.etcdview import etcd_client
from timeslice import AsyncTimeSliceClient
from timeslice_orchestrator.store.keys import Keyspace

pytestmark = pytest.mark.slow


async def test_keys_and_records_that_do_not_decode_stop_no_replica(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(replicas=2, agents=0)
    keys = Keyspace(cluster.prefix)
    etcd = etcd_client(cluster)
    try:
        async with AsyncTimeSliceClient(cluster.targets, job_id="a") as a:
            for group in ("g", "ok"):
                await a.acquire(group, timeout=30)
                await a.yield_(group)
            await etcd.put(keys.root + b"groups/\xff\xfe/holder", b"x")
            await etcd.put(keys.stats("g"), b"not a record")
            await asyncio.sleep(1.0)  # both replicas' watches bring them in
            assert cluster.exited() == {}, cluster.log_tail("r0")

            for _ in range(3):  # the other groups work as before
                await a.acquire("ok", timeout=10)
                await a.yield_("ok")
            # A replica that starts now loads the same keys.
            cluster.stop_replica(0)
            await asyncio.to_thread(cluster.start_replica, 0)
            async with AsyncTimeSliceClient(cluster.targets[:1], job_id="b") as b:
                await b.acquire("ok", timeout=10)
                await b.yield_("ok")
            await asyncio.sleep(0.5)
            assert cluster.exited() == {}, cluster.log_tail("r0")
    finally:
        await etcd.close()
