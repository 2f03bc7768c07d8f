"""Group reads scoped by the caller's certificate, on real replicas over mutual TLS.

The probe of issue 37: every certificate read every group (holder job, epoch, queue) through
ListGroups, GetGroupStatus and WatchGroup, node certificates included. Now a job reads its own
groups with other jobs' ids replaced by a marker, a group of another job answers exactly as a
group that does not exist, a node certificate reads nothing, and an operator (certificate or
token) reads everything, on timeslice.v1 and on the v1alpha1 API alike.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import cast

import pytest
from grpclib.client import Channel
from grpclib.exceptions import GRPCError

from tests.conftest import ClusterFactory
from tests.integration.rawclient import opened
from timeslice.errors import ErrorKind, error_from_status
from timeslice.status_details import KIND_CODEC
from timeslice.tls import TlsFiles, client_context
from timeslice_proto.timeslice.v1 import (
    AcquireEvent,
    AcquireRequest,
    AcquireState,
    GetGroupStatusRequest,
    GroupEvent,
    GroupStatus,
    ListGroupsRequest,
    OpenSessionRequest,
    TimeSliceStub,
    WatchGroupRequest,
)
from timeslice_proto.timeslice_orchestrator import v1alpha1
from timeslice_tools.dev.certs import CertPair, Pki
from timeslice_tools.dev.cluster import LocalCluster

pytestmark = pytest.mark.timeout(90)

ALPHA, BETA = "tenant-alpha", "tenant-beta"
SHARED, ALPHA_ONLY = "shared-gpus", "alpha-gpus"
# What a job reads in place of another job's id (timeslice_orchestrator.visibility).
OTHER = "(other job)"


@asynccontextmanager
async def channel_as(cluster: LocalCluster, pki: Pki, pair: CertPair) -> AsyncIterator[Channel]:
    """A channel to the replica that presents ``pair``'s certificate."""
    host, _, port = cluster.target.split(",")[0].rpartition(":")
    context = await asyncio.to_thread(
        client_context, TlsFiles(str(pki.ca), str(pair.cert), str(pair.key))
    )
    channel = Channel(host, int(port), ssl=context, status_details_codec=KIND_CODEC)
    try:
        yield channel
    finally:
        channel.close()


async def refused(kind: ErrorKind, call: Awaitable[object]) -> str:
    """``call`` must fail with ``kind``; its message."""
    with pytest.raises(GRPCError) as info:
        await call
    error = error_from_status(info.value.status, info.value.message, info.value.details)
    assert error.kind is kind, f"expected {kind}, got {error.kind}: {error}"
    return error.message


async def first_event(
    stub: TimeSliceStub, group: str, metadata: dict[str, str] | None = None
) -> GroupStatus:
    """The first status a WatchGroup stream sends."""
    stream = stub.watch_group(WatchGroupRequest(group_id=group), timeout=10, metadata=metadata)
    try:
        event = cast(GroupEvent, await anext(aiter(stream)))
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    assert event.status is not None
    return event.status


async def drain(stream: AsyncIterator[GroupEvent]) -> None:
    async for _ in stream:
        pass


async def acquired(stub: TimeSliceStub, request: AcquireRequest) -> AcquireEvent:
    events = [e async for e in stub.acquire(request)]
    assert events[-1].state == AcquireState.GRANTED, events
    return events[-1]


async def test_a_job_reads_its_own_groups_only_and_operators_read_all(
    cluster_factory: ClusterFactory, session_pki: Pki
) -> None:
    cluster = cluster_factory(agents=0)  # mutual TLS with the session's CA
    pki = session_pki
    async with (
        channel_as(cluster, pki, pki.job(ALPHA)) as alpha_channel,
        channel_as(cluster, pki, pki.job(BETA)) as beta_channel,
        channel_as(cluster, pki, pki.operator) as operator_channel,
        channel_as(cluster, pki, pki.node("node-0")) as node_channel,
    ):
        alpha, beta = (
            TimeSliceStub(alpha_channel, timeout=10),
            TimeSliceStub(beta_channel, timeout=10),
        )
        operator = TimeSliceStub(operator_channel, timeout=10)
        node = TimeSliceStub(node_channel, timeout=10)
        sa, secret_a = opened(await alpha.open_session(OpenSessionRequest(ALPHA, ttl_seconds=30)))
        sb, secret_b = opened(await beta.open_session(OpenSessionRequest(BETA, ttl_seconds=30)))
        grant = await acquired(alpha, AcquireRequest(sa, ALPHA, SHARED, session_secret=secret_a))
        await acquired(alpha, AcquireRequest(sa, ALPHA, ALPHA_ONLY, session_secret=secret_a))
        waiting = asyncio.create_task(
            acquired(beta, AcquireRequest(sb, BETA, SHARED, session_secret=secret_b))
        )
        try:
            for _ in range(100):
                status = await operator.get_group_status(GetGroupStatusRequest(SHARED))
                if status.queue:
                    break
                await asyncio.sleep(0.1)
            assert [q.job_id for q in status.queue] == [BETA]

            # Beta, queued behind alpha: its own group, alpha's id replaced, counts kept.
            listed = (await beta.list_groups(ListGroupsRequest())).groups
            assert [(g.group_id, g.holder_job_id, g.queue_length) for g in listed] == [
                (SHARED, OTHER, 1)
            ]
            for seen in (
                await beta.get_group_status(GetGroupStatusRequest(SHARED)),
                await first_event(beta, SHARED),
            ):
                assert seen.holder_job_id == OTHER
                assert seen.holder_epoch == grant.epoch
                assert [q.job_id for q in seen.queue] == [BETA]
                assert ALPHA.encode() not in bytes(seen)
            assert ALPHA.encode() not in bytes(await beta.list_groups(ListGroupsRequest()))

            # Alpha's other group is as absent, to beta, as a group that does not exist.
            hidden = await refused(
                ErrorKind.NOT_FOUND, beta.get_group_status(GetGroupStatusRequest(ALPHA_ONLY))
            )
            absent = await refused(
                ErrorKind.NOT_FOUND, beta.get_group_status(GetGroupStatusRequest("no-such"))
            )
            assert hidden.replace(ALPHA_ONLY, "G") == absent.replace("no-such", "G")
            await refused(ErrorKind.NOT_FOUND, first_event(beta, ALPHA_ONLY))

            # Alpha reads both of its groups, beta's id replaced.
            assert [g.group_id for g in (await alpha.list_groups(ListGroupsRequest())).groups] == [
                ALPHA_ONLY,
                SHARED,
            ]
            mine = await alpha.get_group_status(GetGroupStatusRequest(SHARED))
            assert (mine.holder_job_id, [q.job_id for q in mine.queue]) == (ALPHA, [OTHER])
            assert BETA.encode() not in bytes(mine)

            # The operator's certificate reads everything, and so does a job's certificate
            # with the operator token.
            bearer = {"authorization": f"Bearer {cluster.operator_token}"}
            for stub, metadata in ((operator, None), (beta, bearer)):
                groups = (await stub.list_groups(ListGroupsRequest(), metadata=metadata)).groups
                assert {(g.group_id, g.holder_job_id) for g in groups} == {
                    (ALPHA_ONLY, ALPHA),
                    (SHARED, ALPHA),
                }
                full = await stub.get_group_status(GetGroupStatusRequest(SHARED), metadata=metadata)
                assert (full.holder_job_id, [q.job_id for q in full.queue]) == (ALPHA, [BETA])
                assert (await first_event(stub, ALPHA_ONLY, metadata)).holder_job_id == ALPHA

            # A node's certificate reads no group.
            for call in (
                node.list_groups(ListGroupsRequest()),
                node.get_group_status(GetGroupStatusRequest(SHARED)),
                first_event(node, SHARED),
            ):
                await refused(ErrorKind.PERMISSION_DENIED, call)

            # The v1alpha1 API answers the same way.
            compat_beta = v1alpha1.TimeSliceOrchestratorServiceStub(beta_channel, timeout=10)
            compat_op = v1alpha1.TimeSliceOrchestratorServiceStub(operator_channel, timeout=10)
            compat_node = v1alpha1.TimeSliceOrchestratorServiceStub(node_channel, timeout=10)
            assert (await compat_beta.list_groups(v1alpha1.ListGroupsRequest())).group_ids == [
                SHARED
            ]
            shared = await compat_beta.get_group_status(v1alpha1.GetGroupStatusRequest(SHARED))
            assert shared.group is not None and shared.group.locking_job == OTHER
            assert ALPHA.encode() not in bytes(shared)
            await refused(
                ErrorKind.NOT_FOUND,
                compat_beta.get_group_status(v1alpha1.GetGroupStatusRequest(ALPHA_ONLY)),
            )
            # A Yield of a group beta does not hold is refused without naming the holder.
            not_mine = await refused(
                ErrorKind.PERMISSION_DENIED,
                compat_beta.yield_(v1alpha1.YieldRequest(BETA, SHARED)),
            )
            assert ALPHA not in not_mine and OTHER in not_mine, not_mine
            full_v1 = await compat_op.get_group_status(v1alpha1.GetGroupStatusRequest(SHARED))
            assert full_v1.group is not None and full_v1.group.locking_job == ALPHA
            every = (await compat_op.list_groups(v1alpha1.ListGroupsRequest())).group_ids
            assert sorted(every) == [ALPHA_ONLY, SHARED]
            await refused(
                ErrorKind.PERMISSION_DENIED, compat_node.list_groups(v1alpha1.ListGroupsRequest())
            )

            # Beta's only record in the group is its queue entry: when the entry goes, a watch
            # of beta's ends as a read of the group would (it never held: no usage either).
            watch = beta.watch_group(WatchGroupRequest(group_id=SHARED), timeout=20)
            opened_watch = cast(GroupEvent, await anext(aiter(watch))).status
            assert opened_watch is not None and opened_watch.queue[0].job_id == BETA
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            left = await refused(ErrorKind.NOT_FOUND, drain(watch))
            assert left == hidden.replace(ALPHA_ONLY, SHARED)
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
    assert cluster.exited() == {}
