"""Limits per client identity on real processes with mutual TLS (issue 37, items 3 and 4).

- A job's Acquires may create at most ``--max-groups-per-job`` groups: one job cannot take
  every slot of ``--max-groups`` from the others, its refusal names the job and the flag, and
  the idle clean-up gives the job its slots back.
- Admission buckets follow the certificate, not the connection: an operator certificate on
  many connections spends one bucket, so its flood is held to one client's rate and a job's
  acquires beside it stay fast.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from tests.conftest import ClusterFactory
from tests.integration.rawclient import opened
from timeslice.tls import TlsFiles, client_context
from timeslice_proto.timeslice.v1 import (
    AcquireRequest,
    ListGroupsRequest,
    OpenSessionRequest,
    TimeSliceStub,
    YieldRequest,
)
from timeslice_tools.dev.certs import CertPair, Pki


@asynccontextmanager
async def stub_as(target: str, ca: str, pair: CertPair) -> AsyncIterator[TimeSliceStub]:
    """A stub on the first replica of ``target`` presenting ``pair``'s certificate."""
    host, _, port = target.split(",")[0].rpartition(":")
    files = TlsFiles(ca, str(pair.cert), str(pair.key))
    context: ssl.SSLContext = await asyncio.to_thread(client_context, files)
    channel = Channel(host, int(port), ssl=context)
    try:
        yield TimeSliceStub(channel, timeout=10)
    finally:
        channel.close()


async def take(stub: TimeSliceStub, sid: str, secret: str, job: str, group: str) -> int:
    """Acquire ``group`` (free: granted at once); its epoch."""
    request = AcquireRequest(sid, job, group, session_secret=secret)
    events = [ev async for ev in stub.acquire(request)]
    assert events and events[-1].epoch, events
    return events[-1].epoch


async def group_names(stub: TimeSliceStub) -> set[str]:
    return {g.group_id for g in (await stub.list_groups(ListGroupsRequest())).groups}


async def test_one_job_cannot_take_every_group_slot(
    cluster_factory: ClusterFactory, session_pki: Pki
) -> None:
    cluster = cluster_factory(
        agents=0,
        orchestrator_args=["--max-groups=8", "--max-groups-per-job=3", "--idle-group-ttl=1"],
    )
    ca = str(session_pki.ca)
    async with (
        stub_as(cluster.target, ca, session_pki.job("greedy")) as greedy,
        stub_as(cluster.target, ca, session_pki.job("other")) as other,
    ):
        sid, secret = opened(
            await greedy.open_session(OpenSessionRequest(job_id="greedy", ttl_seconds=30))
        )
        # Held groups are never idle: they stay while the quota is checked.
        epochs = {g: await take(greedy, sid, secret, "greedy", g) for g in ("g0", "g1", "g2")}
        # Every slot left of --max-groups is still free, yet the job may take none of them.
        for n in range(3, 8):
            with pytest.raises(GRPCError) as refused:
                await take(greedy, sid, secret, "greedy", f"g{n}")
            assert refused.value.status is Status.RESOURCE_EXHAUSTED, refused.value
            message = str(refused.value.message)
            assert "job greedy" in message and "--max-groups-per-job" in message, message
            assert "limit is 3 per job" in message, message
        assert await group_names(greedy) == {"g0", "g1", "g2"}  # nothing written
        # Another job still creates groups of its own.
        osid, osecret = opened(
            await other.open_session(OpenSessionRequest(job_id="other", ttl_seconds=30))
        )
        for n in range(3):
            await take(other, osid, osecret, "other", f"o{n}")
        # The idle clean-up gives the job its slots back once its groups are gone.
        for group, epoch in epochs.items():
            await greedy.yield_(YieldRequest(sid, "greedy", group, epoch, session_secret=secret))
        deadline = time.monotonic() + 20
        while await group_names(greedy) & set(epochs):
            assert time.monotonic() < deadline, await group_names(greedy)
            await asyncio.sleep(0.2)
        for n in range(3, 6):
            await take(greedy, sid, secret, "greedy", f"g{n}")
    assert cluster.exited() == {}


# An operator's certificate on many connections, each with calls in flight, for SECONDS:
# prints a JSON count of its calls by outcome. Its own process, so the test's event loop
# (where the victim is measured) does not run the flood.
FLOODER = """
import asyncio, json, ssl, sys
from grpclib.client import Channel
from grpclib.exceptions import GRPCError
from timeslice.tls import TlsFiles, client_context
from timeslice_proto.timeslice.v1 import GetGroupStatusRequest, ListGroupsRequest, TimeSliceStub

async def main(host, port, ca, cert, key, connections, per, seconds):
    context = client_context(TlsFiles(ca, cert, key))
    channels = [Channel(host, int(port), ssl=context) for _ in range(int(connections))]
    stubs = [TimeSliceStub(c, timeout=10) for c in channels]
    async def connect(stub):  # a call on each connection, admitted or not
        try:
            await stub.get_group_status(GetGroupStatusRequest(group_id="none"))
        except GRPCError:
            pass
    await asyncio.gather(*(connect(s) for s in stubs))
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # go
    loop = asyncio.get_running_loop()
    end = loop.time() + float(seconds)
    counts = {}
    async def one(stub):
        while loop.time() < end:
            try:
                await stub.list_groups(ListGroupsRequest())
                kind = "OK"
            except GRPCError as exc:
                kind = exc.status.name
            counts[kind] = counts.get(kind, 0) + 1
    await asyncio.gather(*(one(s) for s in stubs for _ in range(int(per))))
    for c in channels:
        c.close()
    print(json.dumps(counts), flush=True)

asyncio.run(main(*sys.argv[1:]))
"""

RATE = 200  # tokens a second per client (ListGroups costs 10)
BURST = 200
MAX_WAIT = 0.5  # seconds a call may wait for tokens (a call admitted after the flood's end)
# 128 calls in flight: past --client-max-waiting (64), so some take no place in line.
CONNECTIONS = 32
PER_CONNECTION = 4
FLOOD_SECONDS = 3.0
LIST_COST = 10


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def test_an_operator_certificate_is_one_client_over_all_its_connections(
    cluster_factory: ClusterFactory, session_pki: Pki
) -> None:
    cluster = cluster_factory(
        agents=0,
        orchestrator_args=[
            f"--client-rate={RATE}",
            f"--client-burst={BURST}",
            f"--client-max-wait={MAX_WAIT}",
        ],
    )
    host, _, port = cluster.targets[0].rpartition(":")
    operator = session_pki.operator
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, host, port, str(session_pki.ca), str(operator.cert),
         str(operator.key), str(CONNECTIONS), str(PER_CONNECTION), str(FLOOD_SECONDS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    latencies: list[float] = []
    try:
        assert flooder.stdout is not None and flooder.stdin is not None
        ready = await asyncio.wait_for(asyncio.to_thread(flooder.stdout.readline), 60)
        assert ready.strip() == "ready", (ready, flooder.poll())
        async with stub_as(cluster.target, str(session_pki.ca), session_pki.job("victim")) as v:
            sid, secret = opened(
                await v.open_session(OpenSessionRequest(job_id="victim", ttl_seconds=30))
            )
            await v.yield_(
                YieldRequest(sid, "victim", "v", await take(v, sid, secret, "victim", "v"),
                             session_secret=secret)
            )  # fmt: skip
            # The connections' buckets waited full until now (idle ones are forgotten).
            await asyncio.sleep(1.1)
            flooder.stdin.write("go\n")
            flooder.stdin.flush()
            started = time.monotonic()
            while time.monotonic() - started < FLOOD_SECONDS:
                t0 = time.perf_counter()
                epoch = await take(v, sid, secret, "victim", "v")
                latencies.append(time.perf_counter() - t0)
                await v.yield_(YieldRequest(sid, "victim", "v", epoch, session_secret=secret))
                await asyncio.sleep(0.02)
        out, _ = await asyncio.to_thread(flooder.communicate, timeout=60)
    finally:
        if flooder.poll() is None:
            flooder.kill()
            flooder.wait(timeout=10)
    counts: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    # One bucket: its burst, and its rate over the flood and the last calls' wait (a second
    # of slack for the start and the end), whatever the number of connections. One bucket
    # per connection admitted CONNECTIONS times that, as far as the replica's CPU went.
    bound = (BURST + RATE * (FLOOD_SECONDS + MAX_WAIT + 1.0)) / LIST_COST
    p95 = _p(latencies, 0.95)
    print(
        f"\noperator flood on {CONNECTIONS} connections for {FLOOD_SECONDS:g} s: {counts} "
        f"(one bucket admits at most {bound:.0f}); victim acquires: {len(latencies)}, p50 "
        f"{statistics.median(latencies) * 1e3:.1f} ms, p95 {p95 * 1e3:.1f} ms, max "
        f"{max(latencies) * 1e3:.1f} ms"
    )
    assert set(counts) <= {"OK", "RESOURCE_EXHAUSTED"}, counts
    assert 0 < counts.get("OK", 0) <= bound, counts
    assert counts.get("RESOURCE_EXHAUSTED", 0) > 0, counts
    assert p95 < 1.0, latencies
    assert cluster.exited() == {}
