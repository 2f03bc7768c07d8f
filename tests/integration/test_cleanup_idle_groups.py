"""Idle groups are removed: thousands of throwaway groups do not stay in etcd or in the replicas.

The probe made 20,000; 5,000 show the same (every one removed, etcd back to its start) in a
quarter of the time (set TIMESLICE_IDLE_GROUPS for the full figure).

etcd's database size is read with the Maintenance Status RPC (``db_size``: the file,
``db_size_in_use``: its live pages). Deleting keys frees nothing by itself: etcd keeps every
revision until it is compacted, and a compacted file keeps its size until it is defragmented
(the pages are reused by later writes). So the test compacts and defragments, as an operator's
etcd maintenance (``--auto-compaction-*`` and a periodic ``etcdctl defrag``) does, and
compares the sizes in use.
"""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as pb_grpc

from tests.conftest import ClusterFactory
from tests.integration.rawclient import opened, raw_stub
from timeslice_proto.timeslice.v1 import (
    AcquireRequest,
    GetGroupStatusRequest,
    ListGroupsRequest,
    OpenSessionRequest,
    YieldRequest,
)
from timeslice_tools.dev.cluster import LocalCluster

GROUPS = int(os.environ.get("TIMESLICE_IDLE_GROUPS", "5000"))
CONCURRENCY = 48


async def db_size(cluster: LocalCluster, *, compact_and_defrag: bool = False) -> tuple[int, int]:
    """(db_size, db_size_in_use) of the cluster's etcd, after maintenance if asked.

    As etcd's ``root`` when the etcd has TLS and auth (only root compacts and defragments).
    """
    pki = cluster.pki
    if pki is None:
        channel = grpc.aio.insecure_channel(cluster.etcd_endpoint)
    else:
        ca, key, cert = await asyncio.to_thread(
            lambda: (
                pki.etcd_ca.read_bytes(),
                pki.etcd_root.key.read_bytes(),
                pki.etcd_root.cert.read_bytes(),
            )
        )
        creds = grpc.ssl_channel_credentials(ca, key, cert)
        channel = grpc.aio.secure_channel(cluster.etcd_endpoint, creds)
    async with channel:
        maintenance = pb_grpc.MaintenanceStub(channel)
        if compact_and_defrag:
            kv = pb_grpc.KVStub(channel)
            revision = (await kv.Range(pb.RangeRequest(key=b"/", limit=1), timeout=10)).header
            await kv.Compact(
                pb.CompactionRequest(revision=revision.revision, physical=True), timeout=60
            )
            await maintenance.Defragment(pb.DefragmentRequest(), timeout=60)
        status = await maintenance.Status(pb.StatusRequest(), timeout=10)
    return status.dbSize, status.dbSizeInUse


@pytest.mark.slow  # about 30 s on 2 cores: 10,000 calls
@pytest.mark.timeout(900)
async def test_idle_groups_are_removed_and_etcd_shrinks(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(
        agents=0,
        etcd_endpoint=None,  # its own etcd: the sizes measured are this test's alone
        orchestrator_args=[
            "--idle-group-ttl=4",
            "--cleanup-batch=2000",
            "--client-rate=0",  # one client making thousands of groups on purpose
            f"--max-groups={GROUPS + 10}",
            f"--max-groups-per-job={GROUPS + 10}",
        ],
    )
    start_size, start_in_use = await db_size(cluster, compact_and_defrag=True)
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
        full_size, full_in_use = await db_size(cluster)

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
    end_size, end_in_use = await db_size(cluster, compact_and_defrag=True)
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
