"""A client that cannot renew its session for a whole TTL counts the session lost on its own.

Client ``a`` talks only to replica r0, which is paused (SIGSTOP): its keepalives get no answer,
etcd expires the session's lease after its TTL, and replica r1 grants the group to ``b``. The
client must not wait for an answer that cannot come to learn that: like etcd's clientv3, it
expires the session at the lease's deadline, counted from the last keepalive that succeeded.
Since that deadline is never later than etcd's, ``a`` has let the group go by the time ``b``
gets it: the two jobs never both believe they hold it.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient

pytestmark = pytest.mark.slow

GROUP = "g"
TTL = 3.0


async def test_a_session_not_renewed_for_its_ttl_is_lost_before_another_job_is_granted(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(replicas=2, agents=0)
    r0, r1 = cluster.targets
    async with (
        AsyncTimeSliceClient([r0], job_id="a", session_ttl=TTL) as a,
        AsyncTimeSliceClient([r1], job_id="b") as b,
    ):
        await a.acquire(GROUP, timeout=30)
        assert a.session_id is not None
        loop = asyncio.get_running_loop()
        replica = cluster.processes["r0"]
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            stalled = loop.time()
            # Granted once etcd has expired a's lease, through the replica that still runs.
            grant = await b.acquire(GROUP, timeout=30)
            assert grant.job_id == "b"
            # a decided on its own, while r0 was still silent, and no later than etcd did.
            assert a.session_id is None
            assert GROUP not in a.grants()
            assert a.last_session_loss is not None
            assert "no KeepAlive succeeded" in a.last_session_loss, a.last_session_loss
            assert loop.time() - stalled < 20, "etcd kept a lease nobody renewed"
        finally:
            # A stopped process takes SIGKILL as it is: r0 never answers a again.
            cluster.kill_replica(0)
        await asyncio.to_thread(replica.wait, 10)
        await b.yield_(GROUP)
