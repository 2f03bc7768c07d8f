"""Yields over one long-lived stream (YieldStream) act and answer exactly as Yield calls do.

Real replicas on a real etcd. On the wire: one stream carries refused yields (each answered
with the status the Yield call gives, the stream going on) and the yield that releases. Through
the SDK: yields of a hand-over loop go over one stream per client, and after the replica is
killed and started again the next yield opens a new stream on the new process.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from tests.conftest import ClusterFactory
from tests.e2e.test_metrics_live import scrape, total
from tests.integration.rawclient import opened, raw_stub
from timeslice import AcquireStage, AsyncTimeSliceClient
from timeslice.errors import ErrorKind, error_from_status
from timeslice_proto.timeslice.v1 import (
    AcquireRequest,
    AcquireState,
    GetGroupStatusRequest,
    OpenSessionRequest,
    YieldRequest,
    YieldStreamReply,
)
from timeslice_tools.dev.cluster import LocalCluster


class _Lockstep:
    """One YieldStream, one request and its reply at a time."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[YieldRequest | None] = asyncio.Queue()

    async def outgoing(self) -> AsyncIterator[YieldRequest]:
        while (request := await self.requests.get()) is not None:
            yield request


def _kind(reply: YieldStreamReply) -> ErrorKind | None:
    if reply.status == 0:
        return None
    assert not reply.message.startswith("["), reply.message
    kind = ErrorKind.__members__.get(reply.kind)
    assert kind is not None, f"reply without its kind: {reply}"
    return error_from_status(Status(reply.status), reply.message, kind).kind


async def test_one_stream_answers_each_yield_with_the_status_of_the_yield_call(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=0, tls=False)
    async with raw_stub(cluster.target, insecure=True) as stub:
        session, secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="job-a", ttl_seconds=30))
        )
        granted = [
            e
            async for e in stub.acquire(
                AcquireRequest(
                    session_id=session, session_secret=secret, job_id="job-a", group_id="g"
                )
            )
        ][-1]
        assert granted.state == AcquireState.GRANTED

        def request(**changes: object) -> YieldRequest:
            fields: dict[str, object] = {
                "session_id": session,
                "session_secret": secret,
                "job_id": "job-a",
                "group_id": "g",
                "epoch": granted.epoch,
            }
            fields.update(changes)
            return YieldRequest(**fields)  # type: ignore[arg-type]

        lockstep = _Lockstep()
        replies = stub.yield_stream(lockstep.outgoing())
        expected = [
            (request(session_secret="x" * 43), ErrorKind.UNAUTHENTICATED),
            # An operator yield (no session) needs an operator identity, which a stream
            # never carries: refused as Yield refuses it without one.
            (request(session_id="", session_secret=""), ErrorKind.PERMISSION_DENIED),
            (request(epoch=granted.epoch + 1000), ErrorKind.NOT_HOLDER),
            (request(group_id="no such group!"), ErrorKind.INVALID_ARGUMENT),
            (request(), None),  # the real one: released
            (request(), ErrorKind.NOT_HOLDER),  # again: nothing left to release
        ]
        async with asyncio.timeout(30):
            for sent, kind in expected:
                lockstep.requests.put_nowait(sent)
                assert _kind(await anext(replies)) == kind, sent
            lockstep.requests.put_nowait(None)
            assert [r async for r in replies] == []  # the server ends it after ours
        status = await stub.get_group_status(GetGroupStatusRequest(group_id="g"))
        assert status.holder_job_id == ""


async def test_the_sdk_yields_over_one_stream_per_client_and_reopens_it(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=0, tls=False)
    tls = cluster.client_tls
    async with (
        AsyncTimeSliceClient(cluster.targets, job_id="job-a", **tls) as a,
        AsyncTimeSliceClient(cluster.targets, job_id="job-b", **tls) as b,
    ):

        async def hand_over(holder: AsyncTimeSliceClient, waiter: AsyncTimeSliceClient) -> None:
            queued = asyncio.Event()
            waiting = asyncio.create_task(
                waiter.acquire(
                    "g",
                    timeout=30,
                    on_progress=lambda p: queued.set() if p.state is AcquireStage.QUEUED else None,
                )
            )
            async with asyncio.timeout(30):
                await queued.wait()
            await holder.yield_("g")
            async with asyncio.timeout(30):
                grant = await waiting
            assert grant.job_id == waiter.job_id and grant.epoch > 0

        await a.acquire("g", timeout=30)
        for _ in range(3):
            await hand_over(a, b)
            await hand_over(b, a)
        assert a._yield_streams.open_streams == 1
        assert b._yield_streams.open_streams == 1

        # The replica goes away under the open streams; the sessions (in etcd) stay.
        cluster.kill_replica(0)
        await asyncio.to_thread(cluster.start_replica, 0)
        await hand_over(a, b)  # a's stream had broken: its yield opens a new one
        await b.yield_("g")
        assert a._yield_streams.open_streams == 1
        assert b._yield_streams.open_streams == 1
        assert (await a.status("g")).holder_job_id == ""
        assert await _open_yield_streams(cluster) == 2  # the restarted replica's own count
    # Each client closed its connection: the replica ends the streams and counts them out.
    async with asyncio.timeout(10):
        while await _open_yield_streams(cluster) != 0:
            await asyncio.sleep(0.05)


async def _open_yield_streams(cluster: LocalCluster) -> float:
    """YieldStreams open on the cluster's replicas, from their /metrics."""
    samples = [s for http in cluster.replica_http for s in await asyncio.to_thread(scrape, http)]
    return total(samples, "timeslice_yield_streams")


async def test_the_sdk_uses_yield_calls_with_an_older_replica(
    cluster_factory: ClusterFactory,
) -> None:
    # A replica of a version before YieldStream (rolling upgrades: new jobs, old replicas).
    older = Path(__file__).parent / "older_replica"
    paths = [str(older), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {"PYTHONPATH": os.pathsep.join(paths), "TIMESLICE_TEST_OLDER_REPLICA": "1"}
    cluster = cluster_factory(agents=0, tls=False, env=env)
    async with raw_stub(cluster.target, insecure=True) as stub:
        replies = stub.yield_stream(_Lockstep().outgoing())
        with pytest.raises(GRPCError):
            await anext(replies)  # the replica really is an older one
    async with AsyncTimeSliceClient(cluster.targets, job_id="job-a", **cluster.client_tls) as a:
        for _ in range(3):
            await a.acquire("g", timeout=30)
            await a.yield_("g")
        assert (await a.status("g")).holder_job_id == ""
        assert a._yield_streams.open_streams == 0
        assert len(a._yield_streams._unsupported) == 1
