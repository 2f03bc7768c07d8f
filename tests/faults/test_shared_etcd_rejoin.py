"""A replica rejoins after a lost lease while another deployment keeps the shared etcd busy.

Deployments may share one etcd under different prefixes. A replica that lost its lease
waited, before its new term, for its copy of etcd to reach the store's current revision,
which writes under the other prefix move without any event reaching its watch: it stayed
not ready until something was written under its own prefix (if its clients only reach
ready replicas, nothing was). It now waits for a write of its own under its prefix.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.conftest import ClusterFactory
from tests.faults.harness import http_get, replica_terms
from timeslice import AsyncTimeSliceClient

pytestmark = pytest.mark.slow


async def test_a_replica_rejoins_while_another_prefix_is_busy(
    cluster_factory: ClusterFactory,
) -> None:
    quiet = cluster_factory(replicas=1, agents=0, replica_ttl=2)
    busy = cluster_factory(replicas=1, agents=0)
    assert quiet.prefix != busy.prefix and quiet.etcd_endpoint == busy.etcd_endpoint
    (address,) = quiet.replica_http
    pid = quiet.services["r0"].pid
    assert pid is not None
    stop = asyncio.Event()

    async def keep_busy() -> None:
        async with AsyncTimeSliceClient(busy.targets, job_id="other") as other:
            while not stop.is_set():
                await other.acquire("g", timeout=10)
                await other.yield_("g")

    before = await replica_terms(address)
    writer = asyncio.create_task(keep_busy())
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(4)  # past its lease's TTL: lost when it wakes
        finally:
            os.kill(pid, signal.SIGCONT)
        woke = time.monotonic()
        while await replica_terms(address) == before:
            assert time.monotonic() - woke < 10, "no new term within 10 s of waking"
            await asyncio.sleep(0.1)
        answer = await http_get(address, "/readyz")
        assert answer is not None and answer[0] == 200, answer
        assert not writer.done()
    finally:
        stop.set()
        await asyncio.wait_for(writer, 15)
    assert quiet.exited() == {}
