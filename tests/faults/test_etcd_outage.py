"""etcd paused past the replica TTL, then killed (-9) and restarted on its data, under load.

Each outage outlasts the replicas' leases. Every replica must give up driving, say it is not
ready, and rejoin with a new lease once etcd is back, without a restart of its process; jobs
see typed errors meanwhile, grants resume within seconds, and no hold overlaps.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest

from tests.conftest import ClusterFactory
from tests.faults.harness import http_get, journals, replica_terms, report_recovery
from timeslice import AsyncTimeSliceClient, register
from timeslice.errors import TimeSliceError
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.history import (
    Attempt,
    Hold,
    Recorder,
    check_fencing,
    check_mutual_exclusion,
)

FAST_SIM = ["--sim-state-gb", "0.25"]
REPLICA_TTL = 2  # seconds: both outages below outlast it several times over
PAUSE = 10.0
KILLED = 6.0
# From etcd's return to the first grant, and to every replica ready again. Generous for a
# loaded 2-core machine; the report has the measured times.
RECOVERY = 15.0
JOBS = ["a", "b", "c"]

pytestmark = pytest.mark.slow


async def _ready(address: str) -> bool:
    answer = await http_get(address, "/readyz")
    return answer is not None and answer[0] == 200


async def _unready(address: str) -> bool:
    return not await _ready(address)


async def _eventually(check: Callable[[], Awaitable[bool]], timeout: float, what: str) -> float:
    """Seconds until ``check()`` holds; fails the test after ``timeout``."""
    started = time.monotonic()
    while not await check():
        assert time.monotonic() - started < timeout, f"{what} not within {timeout:g} s"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


async def _loop(
    client: AsyncTimeSliceClient, recorder: Recorder, stop: asyncio.Event, errors: Counter[str]
) -> None:
    """A job that keeps going through outages: acquire, hold, yield; typed errors are counted
    and the loop goes on (anything else fails the test)."""
    job = client.job_id
    while not stop.is_set():
        started = recorder.now()
        try:
            grant = await client.acquire("g", timeout=20)
        except TimeSliceError as exc:
            recorder.attempt(Attempt(job, "g", started, None, repr(exc)))
            errors[f"acquire: {type(exc).__name__}"] += 1
            await asyncio.sleep(0.05)
            continue
        granted = recorder.now()
        recorder.attempt(Attempt(job, "g", started, granted))
        await asyncio.sleep(0.03)
        recorder.hold(Hold(job, "g", grant.epoch, grant.ticket, granted, recorder.now()))
        try:
            await client.yield_("g")
        except TimeSliceError as exc:
            errors[f"yield: {type(exc).__name__}"] += 1
        await asyncio.sleep(0.01)


async def _outage(
    cluster: LocalCluster,
    recorder: Recorder,
    terms_before: list[int],
    scenario: str,
    down: Callable[[], None],
    up: Callable[[], None],
    seconds: float,
) -> list[int]:
    """Take etcd down for ``seconds``, bring it back, and check the replicas rejoined."""
    await asyncio.to_thread(down)
    went_down = time.monotonic()
    # Every replica reports not ready once its lease is lost (within about its TTL).
    for address in cluster.replica_http:
        await _eventually(functools.partial(_unready, address), seconds, f"{address} not ready")
    await asyncio.sleep(max(0.0, seconds - (time.monotonic() - went_down)))
    holds = len(recorder.holds)
    await asyncio.to_thread(up)
    back = time.monotonic()

    async def granted() -> bool:
        return len(recorder.holds) > holds

    first_grant = await _eventually(granted, RECOVERY, f"{scenario}: a grant after etcd's return")
    report_recovery(f"{scenario}: first grant after", first_grant, outage=back - went_down)
    for address in cluster.replica_http:
        await _eventually(functools.partial(_ready, address), RECOVERY, f"{address} ready again")
    report_recovery(f"{scenario}: every replica ready after", time.monotonic() - back)
    terms = [await replica_terms(address) for address in cluster.replica_http]
    # A new term (a new lease) each, in the same processes.
    assert all(t > b for t, b in zip(terms, terms_before, strict=True)), (terms_before, terms)
    assert cluster.exited() == {}, "no replica or agent exited"
    return terms


async def _each_replica_grants(cluster: LocalCluster) -> None:
    """Every replica, on its own, serves an acquire and a yield."""
    for i, target in enumerate(cluster.targets):
        async with AsyncTimeSliceClient(target, job_id=f"probe-{i}") as probe:
            await probe.acquire(f"probe-{i}", timeout=RECOVERY)
            await probe.yield_(f"probe-{i}")


async def test_replicas_rejoin_after_etcd_pause_and_kill(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(
        replicas=3,
        agents=1,
        etcd_endpoint=None,
        replica_ttl=REPLICA_TTL,
        agent_args=FAST_SIM,
    )
    etcd = cluster.etcd
    assert etcd is not None
    socket = str(cluster.agent_sockets["node-0"])
    workers = [register("g", job_id=j, socket=socket) for j in JOBS]
    recorder = Recorder()
    errors: Counter[str] = Counter()
    stop = asyncio.Event()
    clients = [AsyncTimeSliceClient(cluster.targets, job_id=j) for j in JOBS]
    loops = [asyncio.create_task(_loop(c, recorder, stop, errors)) for c in clients]
    paused = False

    def pause() -> None:
        nonlocal paused
        assert etcd.pid is not None
        os.kill(etcd.pid, signal.SIGSTOP)
        paused = True

    def resume() -> None:
        nonlocal paused
        assert etcd.pid is not None
        os.kill(etcd.pid, signal.SIGCONT)
        paused = False

    def restart() -> None:
        etcd.start()

    try:
        terms = [await replica_terms(address) for address in cluster.replica_http]
        assert terms == [1, 1, 1]
        while len(recorder.holds) < 20:  # well under way
            await asyncio.sleep(0.02)
            assert all(not t.done() for t in loops), [t for t in loops if t.done()]
        terms = await _outage(cluster, recorder, terms, "etcd paused", pause, resume, PAUSE)
        before = {j: sum(h.job == j for h in recorder.holds) for j in JOBS}
        await _outage(cluster, recorder, terms, "etcd killed", etcd.kill, restart, KILLED)
        await _each_replica_grants(cluster)

        # Nothing stays stuck: every job is granted again after the second outage.
        async def everyone_served() -> bool:
            return all(sum(h.job == j for h in recorder.holds) > before[j] + 2 for j in JOBS)

        await _eventually(everyone_served, RECOVERY, "every job granted again")
        stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), 60)
    finally:
        stop.set()
        if paused:
            resume()
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        for c in clients:
            await c.close()
        for w in workers:
            w.close()
    # Calls retry through an outage of this length; what still failed was typed (see _loop).
    report_recovery("etcd outages: typed errors seen by the jobs", 0.0, errors=dict(errors))
    check_mutual_exclusion(recorder.holds)
    entries = journals(cluster)
    assert entries, "the agent journaled no directive"
    check_fencing(entries)
    assert cluster.exited() == {}, "every service rode out both outages"
    for name in cluster.replica_ids:
        log = cluster.log_tail(name, 400)
        assert "rejoined with lease" in log, f"{name} never rejoined:\n{log}"
