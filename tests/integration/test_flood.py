"""A flood of sessions and groups from one client does not slow another job's acquire by 2x.

The victim takes and gives back its group in a loop, first alone, then while a flooding
client (its own process, so the two do not share an event loop) opens sessions and acquires
new groups as fast as it can, far past its quotas. The victim's acquire latency is printed
for both phases; the flood's refusals are typed and cheap, and quota checks cost the same
whatever the store holds, so the median may at most double (with 2 ms of slack for timer
noise on a shared machine).
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time

import pytest

from tests.conftest import ClusterFactory
from tests.integration.rawclient import raw_stub
from timeslice_proto.timeslice.v1 import AcquireRequest, OpenSessionRequest, YieldRequest

ROUNDS = 150

FLOODER = """
import asyncio, sys
from grpclib.client import Channel
from grpclib.exceptions import GRPCError
from timeslice.tls import client_context, client_tls_from_env
from timeslice_proto.timeslice.v1 import AcquireRequest, OpenSessionRequest, TimeSliceStub

async def main(host, port, seconds):
    files = client_tls_from_env()  # the session's certificates (tests/conftest.py)
    channel = Channel(host, int(port), ssl=None if files is None else client_context(files))
    stub = TimeSliceStub(channel, timeout=10)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    counts = {}
    async def one(worker):
        n = 0
        while loop.time() < end:
            n += 1
            try:
                opened = await stub.open_session(OpenSessionRequest(job_id="flood"))
                sid = opened.session_id
                for g in range(8):
                    request = AcquireRequest(sid, "flood", f"flood-{worker}-{n}-{g}")
                    async for _ in stub.acquire(request):
                        pass
                kind = "ok"
            except GRPCError as exc:
                kind = exc.status.name
            counts[kind] = counts.get(kind, 0) + 1
    await asyncio.gather(*(one(w) for w in range(16)))
    channel.close()
    print(counts, flush=True)

asyncio.run(main(*sys.argv[1:3], float(sys.argv[3])))
"""


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


async def _victim(target: str) -> list[float]:
    latencies = []
    async with raw_stub(target) as stub:
        sid = (
            await stub.open_session(OpenSessionRequest(job_id="victim", ttl_seconds=60))
        ).session_id
        for _ in range(ROUNDS):
            started = time.perf_counter()
            events = [ev async for ev in stub.acquire(AcquireRequest(sid, "victim", "v"))]
            latencies.append(time.perf_counter() - started)
            await stub.yield_(YieldRequest(sid, "victim", "v", events[-1].epoch))
            await asyncio.sleep(0.005)
    return latencies


@pytest.mark.xfail(
    strict=True,
    reason="not met yet: refusals are typed and O(1), but a replica serves requests first come "
    "first served, so 16 flooding streams still queue the victim's calls (measured p50 5-10x); "
    "needs per-connection admission (in-flight limit or rate per peer/job)",
)
async def test_flood_does_not_double_a_neighbours_acquire_latency(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(
        agents=0,
        orchestrator_args=["--max-sessions-per-job=64", "--max-groups=1000", "--max-sessions=200"],
    )
    target = cluster.targets[0]
    await _victim(target)  # warm-up: connections, caches
    alone = await _victim(target)
    host, _, port = target.rpartition(":")
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, host, port, "60"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        await asyncio.sleep(3.0)  # the flood reaches its quotas
        flooded = await _victim(target)
    finally:
        flooder.terminate()
        out, _ = flooder.communicate(timeout=30)
    base50, base95 = statistics.median(alone) * 1e3, _p(alone, 0.95) * 1e3
    flood50, flood95 = statistics.median(flooded) * 1e3, _p(flooded, 0.95) * 1e3
    print(
        f"\nvictim acquire latency over {ROUNDS} rounds: alone p50 {base50:.2f} ms "
        f"p95 {base95:.2f} ms; during the flood p50 {flood50:.2f} ms p95 {flood95:.2f} ms "
        f"(ratio p50 {flood50 / base50:.2f}, p95 {flood95 / base95:.2f}); flood calls: "
        f"{out.strip()}"
    )
    assert flood50 <= 2 * base50 + 2.0, (base50, flood50)
    assert cluster.exited() == {}
