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
import re
import signal
import time

import pytest

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient
from timeslice_tools.dev import _procs

pytestmark = pytest.mark.slow

_TERMS = re.compile(rb"^timeslice_replica_terms_total (\S+)$", re.MULTILINE)


async def _get(address: str, path: str) -> tuple[int, bytes] | None:
    return await asyncio.to_thread(_procs.http_status, f"http://{address}{path}", 1.0)


async def _terms(address: str) -> int:
    """Terms the replica began (a new one each time it rejoined)."""
    answer = await _get(address, "/metrics")
    assert answer is not None and answer[0] == 200, f"no metrics from {address}"
    found = _TERMS.search(answer[1])
    assert found is not None, "timeslice_replica_terms_total missing"
    return int(float(found.group(1)))


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

    before = await _terms(address)
    writer = asyncio.create_task(keep_busy())
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(4)  # past its lease's TTL: lost when it wakes
        finally:
            os.kill(pid, signal.SIGCONT)
        woke = time.monotonic()
        while await _terms(address) == before:
            assert time.monotonic() - woke < 10, "no new term within 10 s of waking"
            await asyncio.sleep(0.1)
        answer = await _get(address, "/readyz")
        assert answer is not None and answer[0] == 200, answer
        assert not writer.done()
    finally:
        stop.set()
        await asyncio.wait_for(writer, 15)
    assert quiet.exited() == {}
