"""The grant gap when the etcd leader is lost: about etcd's election time, not a call deadline.

The store's client first, on a 3-member etcd: a write sent through a follower just as the
leader is killed or paused (forwarded to a leader that will never answer it), and a write
to a paused member, each end typed well before the 5 s call deadline; a read to a paused
member is answered by another one.

Then the service: two jobs hand one group back and forth through one replica on a 3-member
etcd. The leader is killed (SIGKILL), brought back, then paused (SIGSTOP: its connections
stay open and it answers nothing). A call in flight then (to the lost leader, or to a
follower that forwarded a write to it) used to wait for its full 5 s deadline; the member
probe of the store's client ends it once its member is found silent or leaderless, so
grants resume as soon as a new leader serves them. The longest gap between two grants at
each fault is compared with etcd's own election time (from the fault until a live member
names a new leader).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Iterator

import pytest

from tests.conftest import ClusterFactory
from tests.faults.etcd_load import Cycle, Load, grants_after, longest_gap, restored, run_job
from tests.faults.harness import report_recovery
from timeslice import AsyncTimeSliceClient
from timeslice_orchestrator.store.etcd import EtcdClient, MemberProbe, StoreUnavailable
from timeslice_tools.dev.etcd import EtcdCluster
from timeslice_tools.history import check_fifo, check_mutual_exclusion

GROUP = "g"
JOBS = ("a", "b")
CALL_TIMEOUT = 10.0  # the SDK's bound on each call: past the etcd client's 5 s deadline
ACQUIRE_TIMEOUT = 20.0
CYCLE = Cycle(GROUP, ACQUIRE_TIMEOUT, CALL_TIMEOUT, hold=0.02, pause=0.005)
# etcd elects a new leader in 1-2 s (election timeout 1 s, randomised up to 2x); the target
# is a gap within 1 s of that. 2 s is the bound the client is built for; a loaded 2-core
# machine gets a margin on top. Before the probe the gap was a call deadline: 5 s.
GAP_LIMIT = 3.0


DEADLINE = 5.0  # the store client's call deadline (its default)
# How soon a call must end once its member is silent: the probe's start and timeout (0.5 s
# each), with a loaded 2-core machine's margin; the deadline is 5 s.
SILENT_LIMIT = 2.5


# -- the store's client ------------------------------------------------------------------


@pytest.fixture(scope="module")
def etcd3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(3, tmp_path_factory.mktemp("etcd3"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


async def _leader(cluster: EtcdCluster) -> tuple[int, int]:
    """The leader's index and member ID."""
    leader = await asyncio.to_thread(cluster.wait_for_leader)
    answer = await asyncio.to_thread(cluster.members[leader].status, 1.0)
    assert answer is not None
    return leader, answer[0]


async def _took(coro: Awaitable[object]) -> tuple[float, BaseException | None]:
    started = time.monotonic()
    try:
        await coro
    except StoreUnavailable as exc:
        return time.monotonic() - started, exc
    return time.monotonic() - started, None


@pytest.mark.parametrize("fault", ["kill", "pause"])
async def test_a_write_through_a_follower_ends_soon_after_the_leader_is_lost(
    etcd3: EtcdCluster, fault: str
) -> None:
    """The follower forwards the write to the leader, which is lost: etcd would answer only
    at its own request timeout (5 s or more); the client's deadline (5 s) came first."""
    etcd = EtcdClient([etcd3.endpoint], timeout=DEADLINE)
    key = f"/timeslice/gap/{time.monotonic_ns()}".encode()
    async with restored(etcd3):
        leader, leader_id = await _leader(etcd3)
        await etcd.put(key, b"before")
        follower = (leader + 1) % 3
        etcd._current = follower
        await etcd.get(key)  # the client has seen the term
        at = time.monotonic()
        if fault == "kill":
            await asyncio.to_thread(etcd3.kill, leader)
        else:
            etcd3.pause(leader)
        writing = asyncio.ensure_future(_took(etcd.put(key, b"during")))
        election = await asyncio.to_thread(etcd3.elected_since, leader, leader_id, at)
        took, error = await writing
        print(
            f"\nleader {fault}: a write through a follower ended after {took:.2f} s "
            f"({error or 'applied'}); etcd elected a new leader in {election:.2f} s"
        )
        assert took < max(election + 1.0, SILENT_LIMIT) + 0.5, (
            f"the write took {took:.2f} s (deadline {DEADLINE:g} s); new leader after "
            f"{election:.2f} s"
        )
        # Writes go on through the new leader.
        deadline = time.monotonic() + 10
        while True:
            try:
                await etcd.put(key, b"after")
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "no write went through after the election"
                await asyncio.sleep(0.05)
    await etcd.close()


async def test_calls_to_a_paused_member_end_at_the_probe_not_the_deadline(
    etcd3: EtcdCluster,
) -> None:
    etcd = EtcdClient([etcd3.endpoint], timeout=DEADLINE)
    key = f"/timeslice/gap/{time.monotonic_ns()}".encode()
    async with restored(etcd3):
        leader, _ = await _leader(etcd3)
        await etcd.put(key, b"before")
        follower = (leader + 1) % 3
        etcd._current = follower
        etcd3.pause(follower)
        # A write may have been applied: it ends, typed, and is not sent again.
        took, error = await _took(etcd.put(key, b"during"))
        assert isinstance(error, StoreUnavailable), error
        assert "status probe" in str(error), error
        assert took < SILENT_LIMIT, f"a write to a paused member took {took:.2f} s"
        # The next call goes elsewhere at once, and a read is answered by another member.
        etcd._current = follower
        etcd._members[follower].failed_until = 0.0
        started = time.monotonic()
        kv = await etcd.get(key)
        took = time.monotonic() - started
        assert kv is not None and kv.value in (b"before", b"during")
        assert took < SILENT_LIMIT, f"a read to a paused member took {took:.2f} s"
        assert etcd.current_endpoint != etcd3.endpoints[follower]
    await etcd.close()


async def test_a_slow_call_on_a_live_member_is_left_to_finish(etcd3: EtcdCluster) -> None:
    """The probe ends calls whose member is lost, not calls that merely wait: with probes
    from 1 ms on, many calls at once all wait past it, their members answer the probes,
    and every call gets its answer."""
    etcd = EtcdClient([etcd3.endpoint], timeout=DEADLINE, probe=MemberProbe(after=0.001))
    key = f"/timeslice/gap/{time.monotonic_ns()}".encode()
    async with restored(etcd3):
        await etcd.put(key, b"v")
        values = await asyncio.gather(*(etcd.get(key) for _ in range(200)))
        assert all(kv is not None and kv.value == b"v" for kv in values)
        writes = await asyncio.gather(*(etcd.put(key + str(i).encode(), b"w") for i in range(50)))
        assert len(writes) == 50
        assert etcd.probes_sent > 0, "no call waited long enough to be probed"
    await etcd.close()


# -- the service -------------------------------------------------------------------------


async def _lose_leader(etcd: EtcdCluster, load: Load, fault: str) -> tuple[float, float]:
    """Lose the leader by ``fault`` ("kill" or "pause"); the longest grant gap around it and
    etcd's election time. The member is back (restarted or resumed) when this returns."""
    leader = await asyncio.to_thread(etcd.wait_for_leader)
    answer = await asyncio.to_thread(etcd.members[leader].status, 1.0)
    assert answer is not None
    leader_id = answer[0]
    await grants_after(load, time.monotonic(), 10, 30, "before the fault")
    at = time.monotonic()
    if fault == "kill":
        await asyncio.to_thread(etcd.kill, leader)
    else:
        etcd.pause(leader)
    try:
        election = await asyncio.to_thread(etcd.elected_since, leader, leader_id, at)
        await grants_after(load, at + election, 10, 30, "after the election")
    finally:
        if fault == "kill":
            await asyncio.to_thread(etcd.start_member, leader)
        else:
            etcd.resume(leader)
    gap = longest_gap(load.recorder.holds, at, at + election)
    await asyncio.to_thread(etcd.wait_for_leader)
    return gap, election


@pytest.mark.slow
async def test_grant_gap_at_an_etcd_leader_loss_is_about_the_election_time(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(replicas=1, agents=0, etcd_members=3)
    etcd = cluster.etcd_cluster
    assert etcd is not None
    load = Load()
    clients = [
        AsyncTimeSliceClient(cluster.targets, job_id=j, call_timeout=CALL_TIMEOUT) for j in JOBS
    ]
    runs = [asyncio.create_task(run_job(c, load, CYCLE)) for c in clients]
    results: dict[str, tuple[float, float]] = {}
    try:
        for fault in ("kill", "pause"):
            results[fault] = await _lose_leader(etcd, load, fault)
        load.stop.set()
        await asyncio.wait_for(asyncio.gather(*runs), ACQUIRE_TIMEOUT + 2 * CALL_TIMEOUT)
    finally:
        load.stop.set()
        for run in runs:
            run.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*runs, return_exceptions=True)
        for c in clients:
            await c.close()
    holds = load.recorder.holds
    check_mutual_exclusion(holds)
    check_fifo(holds)
    lines = []
    for fault, (gap, election) in results.items():
        report_recovery(f"etcd leader {fault}: longest grant gap", gap, election=election)
        lines.append(f"leader {fault}: longest grant gap {gap:.2f} s, election {election:.2f} s")
    print("\n" + "\n".join(lines) + f"\ngrants {len(holds)}; typed errors {dict(load.errors)}")
    for fault, (gap, election) in results.items():
        assert gap < GAP_LIMIT, (
            f"leader {fault}: no grant for {gap:.2f} s (etcd elected a new leader in "
            f"{election:.2f} s)\n" + "\n".join(lines)
        )
