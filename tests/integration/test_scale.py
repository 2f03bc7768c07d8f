"""A replica starts on a deployment of 100,000 groups (issue 13, finding 4).

One read of the whole key prefix is one gRPC message; past a few thousand groups it exceeded
the etcd client's 4 MiB receive limit and a replica could not start at all. The mirror now
lists in pages at one revision. The deployment is built the quick way: some thousands of real
groups through the store's own transactions (a grant and a yield each), then their keys copied
in bulk under new group names, so every group looks like a used one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from timeslice import AsyncTimeSliceClient
from timeslice_orchestrator.store.etcd import EtcdClient, KeyValue, Put, StoreUnavailable, Txn
from timeslice_orchestrator.store.groups import EnqueueRequest, FreeGroup, GroupStore, Hold
from timeslice_orchestrator.store.keys import Keyspace, Kind
from timeslice_orchestrator.store.records import GroupStats, ResidentRecord, SessionRecord, Stored
from timeslice_tools.dev._procs import http_status
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.dev.etcd import EtcdServer

pytestmark = pytest.mark.slow

PREFIX = "/scale/groups"
TOTAL = int(os.environ.get("TIMESLICE_SCALE_GROUPS", "100000"))
# 5,000 real groups (4 s to build; the rest are copies of them): 20,000 took 15 s more and
# found nothing the copies do not.
REAL = min(TOTAL, int(os.environ.get("TIMESLICE_SCALE_REAL_GROUPS", "5000")))
JOBS = 20  # sessions the real groups are taken and given back by
# The start target is 10 s from launch to /readyz answering 200 (issue 13, a quiet machine).
# `make test` runs this beside other tests on 2 cores, where the wall time stretches with
# the load (10.1 s was seen once in five clean runs, over 15 s beside the 10-minute soak,
# over 30 s twice in clean-clone pairs beside the other suite's heaviest tests), so the
# target is asserted on what load does not stretch: the CPU seconds the replica spent until
# it was ready (what its start costs; on a quiet machine that is about its wall time). Alone:
# 5.3-6.3 s wall (2026-12-02); 8.6 CPU s (9.8 s wall) on 2026-12-06, when the dashboard's
# start decoded every group's records, 6.9 CPU s (7.7 s) once it skipped the idle ones. CPU
# time is stretched by load too: 11.2 CPU s with three test workers on 2 cores.
START_TARGET_CPU = 10.0
# The wall-time bound catches a start that waited (a timeout and retry), not a slow machine.
# The cluster's own ready timeout is well above it, so that the bound fails on its own.
START_WITHIN = 60.0
READY_TIMEOUT = START_WITHIN + 60.0
TXN_OPS = 128  # etcd's default --max-txn-ops
OLD_RECEIVE_LIMIT = 4 * 1024 * 1024  # gRPC's default, which the unpaged read ran into


def name(i: int) -> str:
    return f"g{i:06d}"


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of its own: 100,000 groups would slow every other test on the shared one."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.close()


async def bounded(n: int, limit: int, step: object) -> None:
    """Run ``step(i)`` for i in range(n), ``limit`` at a time."""
    assert callable(step)
    next_i = iter(range(n))

    async def worker() -> None:
        for i in next_i:
            await step(i)

    async with asyncio.timeout(120):
        await asyncio.gather(*(worker() for _ in range(limit)))


def held(i: int) -> bool:
    """Whether real group ``i`` is left held; the others were granted and yielded."""
    return i % 2 == 1


async def real_groups(store: GroupStore) -> None:
    """``REAL`` groups each granted to a job, as Acquire does, and half of them yielded."""
    sessions: list[tuple[str, Stored[SessionRecord]]] = []
    for j in range(JOBS):
        session_id = await store.open_session(f"job-{j}", 600, "host", j)
        sessions.append((session_id, await store.session(session_id)))

    async def use(i: int) -> None:
        session_id, session = sessions[i % JOBS]
        job = session.record.job
        request = EnqueueRequest(session, session_id, name(i), 0, f"r{i}", "a")
        free = FreeGroup(0, ResidentRecord({"node-0": [job]}), 0, GroupStats(grants=1), 0, 0)
        taken = await store.take_free(request, free)
        assert taken is not None, f"{name(i)} was not free"
        if not held(i):
            await store.release(Hold(name(i), job, taken.epoch, session_id))

    await bounded(REAL, 128, use)


async def bulk_groups(store: GroupStore) -> None:
    """Groups ``REAL``..``TOTAL``: copies of the real groups' keys under new names."""
    keys = store.keys
    key_of = {Kind.META: keys.meta, Kind.RESIDENT: keys.resident}
    key_of |= {Kind.STATS: keys.stats, Kind.USAGE: keys.usage}
    _, kvs = await store.etcd.get_prefix(keys.root)
    found: dict[str, list[tuple[Kind, bytes]]] = {}
    for kv in kvs:
        ref = keys.parse(kv.key)
        if ref is not None and ref.group:
            found.setdefault(ref.group, []).append((ref.kind, kv.value))
    # The yielded groups are the models (a hold lives on its session's lease).
    cycle = [m for m in found.values() if {kind for kind, _ in m} == set(key_of)]
    assert len(found) == REAL and len(cycle) == REAL - REAL // 2
    per_txn = TXN_OPS // len(key_of)
    batches = [range(i, min(i + per_txn, TOTAL)) for i in range(REAL, TOTAL, per_txn)]

    async def write(b: int) -> None:
        ops = [
            Put(key_of[kind](name(i)), value)
            for i in batches[b]
            for kind, value in cycle[i % len(cycle)]
        ]
        assert (await store.etcd.txn(Txn([], ops))).succeeded

    await bounded(len(batches), 64, write)


async def _delete_all(client: EtcdClient, prefix: bytes) -> None:
    """Delete every key under ``prefix`` in one DeleteRange (one revision).

    On a loaded machine etcd may answer "request timed out" (its own apply deadline) for so
    large a delete and still apply it later: it is sent again until no key is left."""
    for _ in range(5):
        try:
            await client.delete(prefix, prefix=True)
        except StoreUnavailable:
            await asyncio.sleep(1.0)
        left: list[KeyValue] = []
        async with contextlib.aclosing(client.pages(prefix, page=1)) as pages:
            async for _, chunk in pages:
                left = chunk  # one key is enough to know
                break
        if not left:
            return
    raise AssertionError(f"keys still under {prefix!r} after 5 deletes")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` has used, all its threads together."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def vm_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


@contextlib.contextmanager
def _answer_gaps(url: str) -> Iterator[list[float]]:
    """Ask ``url`` again as soon as it answers, in a thread, until the block ends; yields the
    seconds between answers (the first counted from the start), filled in as it goes."""
    gaps: list[float] = []
    wrong: list[object] = []  # an answer other than 200 (the thread cannot raise it here)
    stop = threading.Event()

    def ask() -> None:
        last = time.monotonic()
        while not stop.is_set():
            answer = http_status(url, timeout=30)
            if answer is None or answer[0] != 200:
                wrong.append(answer)
                return
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    try:
        yield gaps
    finally:
        stop.set()
        asker.join(35)
    assert not wrong, f"{url} answered {wrong[0]!r}"
    assert gaps, "the replica never answered"


# Each step has a deadline of its own (building 120 s, the start 60 s, the listing 60 s, the
# delete 30 s): beside another suite's heaviest tests the whole took over the default 180 s.
@pytest.mark.timeout(600)
async def test_a_replica_starts_on_100k_groups(etcd: EtcdServer, tmp_path: Path) -> None:
    client = EtcdClient([etcd.endpoint], timeout=30)
    store = GroupStore(client, Keyspace(PREFIX))
    try:
        began = time.monotonic()
        await real_groups(store)
        built_real = time.monotonic()
        await bulk_groups(store)
        built = time.monotonic()
        # The deployment is far past what one message could carry: the unpaged read failed.
        revision, kvs = await client.get_prefix(store.keys.root)
        size = sum(len(kv.key) + len(kv.value) for kv in kvs)
        groups = {ref.group for kv in kvs if (ref := store.keys.parse(kv.key)) and ref.group}
        group_prefix = f"{PREFIX}/groups/".encode()
        assert len(groups) == TOTAL
        if TOTAL == 100_000:
            assert size > 2 * OLD_RECEIVE_LIMIT
        print(
            f"\n{REAL} real groups in {built_real - began:.1f} s, {TOTAL - REAL} copies in "
            f"{built - built_real:.1f} s: {len(kvs)} keys, {size / 2**20:.1f} MiB at revision "
            f"{revision}"
        )
    finally:
        await client.close()

    cluster = LocalCluster(
        replicas=1,
        agents=0,
        etcd_endpoint=etcd.endpoint,
        prefix=PREFIX,
        base_dir=tmp_path / "cluster",
        ready_timeout=READY_TIMEOUT,
    )
    launched = time.monotonic()
    with cluster:
        started = time.monotonic() - launched
        pid = cluster.processes["r0"].pid
        cpu = cpu_seconds(pid)
        rss = vm_rss_mib(pid)
        print(
            f"replica ready in {started:.2f} s ({cpu:.2f} CPU s) with {TOTAL} groups; "
            f"VmRSS {rss:.0f} MiB"
        )
        assert cpu < START_TARGET_CPU, f"the start took {cpu:.2f} CPU s ({started:.2f} s)"
        assert started < START_WITHIN, f"ready after {started:.2f} s ({cpu:.2f} CPU s)"
        # It serves: every group is listed, and a real group is granted to a new job.
        # A plaintext cluster (it shares this test's plaintext etcd): its client says so.
        # Listing 100,000 groups is one large answer: more than the default call bound of
        # 10 s on 2 loaded cores (seen beside the soak and a CI run).
        async with AsyncTimeSliceClient(
            cluster.target, job_id="newcomer", call_timeout=60, **cluster.client_tls
        ) as sdk:
            with _answer_gaps(f"http://{cluster.replica_http[0]}/healthz") as gaps:
                listing = time.monotonic()
                listed = await sdk.groups()
                listing = time.monotonic() - listing
            # The replica answers other calls while it lists (its lease keepalive too): the
            # listing is read in slices and encoded in a thread, not in one long stall.
            print(f"listed in {listing:.2f} s; longest gap between /healthz answers meanwhile "
                  f"{max(gaps):.2f} s")  # fmt: skip
            assert max(gaps) < 0.3 * listing
            # Its lease outlived the first read (longer than the lease's TTL here) and the
            # listing: it was granted after the one and kept alive through the other.
            log = cluster.services["r0"].log_path.read_text(errors="replace").splitlines()
            lapses = [
                line for line in log if "lease" in line and ("expired" in line or "lost" in line)
            ]
            assert not lapses, lapses
            assert len(listed) == TOTAL
            assert {g.group_id for g in listed} >= {name(0), name(TOTAL - 1)}
            assert sum(bool(g.holder_job_id) for g in listed) == REAL // 2
            grant = await sdk.acquire(name(2), timeout=10)
            assert grant.epoch > revision
            await sdk.yield_(name(2))
            print(f"after serving: VmRSS {vm_rss_mib(pid):.0f} MiB")
            # One revision that deletes every group: ~400,000 events, some 25 MiB in one
            # watch response (six times gRPC's default limit). The replica follows.
            deleting = time.monotonic()
            etcd_client = EtcdClient([etcd.endpoint], timeout=30)
            try:
                await _delete_all(etcd_client, group_prefix)
            finally:
                await etcd_client.close()
            deleted = sum(kv.key.startswith(group_prefix) for kv in kvs)
            assert deleted >= 4 * TOTAL
            async with asyncio.timeout(30):
                while await sdk.groups():
                    await asyncio.sleep(0.2)
            print(f"{deleted} keys deleted at once, seen in {time.monotonic() - deleting:.1f} s")
