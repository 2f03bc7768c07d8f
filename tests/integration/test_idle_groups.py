"""Idle groups are removed: 20,000 throwaway groups do not stay in etcd or in the replicas.

etcd's database size is read with the Maintenance Status RPC (``db_size``: the file,
``db_size_in_use``: its live pages). Deleting keys frees nothing by itself: etcd keeps every
revision until it is compacted, and a compacted file keeps its size until it is defragmented
(the pages are reused by later writes). So the test compacts and defragments, as an operator's
etcd maintenance (``--auto-compaction-*`` and a periodic ``etcdctl defrag``) does, and
compares the sizes in use.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as pb_grpc

from tests.conftest import ClusterFactory
from tests.integration.rawclient import opened, raw_stub
from timeslice_orchestrator.store.etcd import EtcdClient, Txn
from timeslice_proto.timeslice.v1 import (
    AcquireRequest,
    GetGroupStatusRequest,
    ListGroupsRequest,
    OpenSessionRequest,
    YieldRequest,
)

GROUPS = 20_000
CONCURRENCY = 48


async def db_size(endpoint: str, *, compact_and_defrag: bool = False) -> tuple[int, int]:
    """(db_size, db_size_in_use) of the etcd at ``endpoint``, after maintenance if asked."""
    if compact_and_defrag:
        client = EtcdClient([endpoint])
        try:
            revision = (await client.txn(Txn([]))).revision
            await client.compact(revision)
        finally:
            await client.close()
    async with grpc.aio.insecure_channel(endpoint) as channel:
        maintenance = pb_grpc.MaintenanceStub(channel)
        if compact_and_defrag:
            await maintenance.Defragment(pb.DefragmentRequest(), timeout=60)
        status = await maintenance.Status(pb.StatusRequest(), timeout=10)
    return status.dbSize, status.dbSizeInUse


@pytest.mark.slow  # about 2 minutes on 2 cores: 40,000 calls
@pytest.mark.timeout(900)
async def test_idle_groups_are_removed_and_etcd_shrinks(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(
        agents=0,
        etcd_endpoint=None,  # its own etcd: the sizes measured are this test's alone
        orchestrator_args=[
            "--idle-group-ttl=4",
            "--cleanup-batch=2000",
            "--client-rate=0",  # one client making 20,000 groups on purpose
            f"--max-groups={GROUPS + 10}",
        ],
    )
    endpoint = cluster.etcd_endpoint
    start_size, start_in_use = await db_size(endpoint, compact_and_defrag=True)
    async with raw_stub(cluster.target) as stub:
        sid, secret = opened(
            await stub.open_session(OpenSessionRequest(job_id="t", ttl_seconds=3600))
        )
        names = iter(range(GROUPS))
        started = time.monotonic()

        async def churn() -> None:
            # Throwaway groups, as the probe made them: acquire (granted at once), yield.
            for i in names:
                group = f"throwaway-{i}"
                events = [
                    ev
                    async for ev in stub.acquire(
                        AcquireRequest(sid, "t", group, session_secret=secret)
                    )
                ]
                await stub.yield_(
                    YieldRequest(sid, "t", group, events[-1].epoch, session_secret=secret)
                )

        async with asyncio.timeout(600):
            await asyncio.gather(*(churn() for _ in range(CONCURRENCY)))
        made = time.monotonic() - started
        listed = len((await stub.list_groups(ListGroupsRequest())).groups)
        full_size, full_in_use = await db_size(endpoint)

        # A group whose state is resident somewhere, or that is held, is never idle.
        events = [
            ev async for ev in stub.acquire(AcquireRequest(sid, "t", "kept", session_secret=secret))
        ]
        assert events[-1].epoch

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            groups = (await stub.list_groups(ListGroupsRequest())).groups
            if [g.group_id for g in groups] == ["kept"]:
                break
            await asyncio.sleep(0.5)
        emptied = time.monotonic() - started - made
        assert [g.group_id for g in groups] == ["kept"], f"{len(groups)} groups left"
        kept = await stub.get_group_status(GetGroupStatusRequest(group_id="kept"))
        assert kept.holder_job_id == "t"
    end_size, end_in_use = await db_size(endpoint, compact_and_defrag=True)
    print(
        f"\n{GROUPS} throwaway groups made in {made:.1f} s ({listed} listed at the end), "
        f"removed {emptied:.1f} s later\n"
        f"etcd db (file / in use): start {start_size} / {start_in_use} B, "
        f"with the groups {full_size} / {full_in_use} B, "
        f"after clean-up + compact + defrag {end_size} / {end_in_use} B"
    )
    # Most groups were already gone while others were still being made: "listed" is what was
    # left then. What matters: etcd is back near where it started, far below the peak.
    assert end_in_use < start_in_use + 256 * 1024, (start_in_use, end_in_use)
    assert end_size < max(full_size, 2 * start_size), (full_size, end_size)
    assert cluster.exited() == {}
