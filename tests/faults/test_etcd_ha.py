"""etcd itself highly available: a 3-member cluster on loopback, members lost under load.

- The store's client by DNS name (``localhost:P1,localhost:P2,localhost:P3``), plaintext and
  TLS: a killed member and a paused (SIGSTOP) one are left for the others; reads, writes,
  watches (resumed from the last revision, no gap, no duplicate) and lease keepalives go on.
- 4 jobs through 2 replicas while the etcd leader is killed (-9), the old member restarted on
  its data, then a follower paused for 10 s: mutual exclusion, FIFO, fencing, no grant lost,
  no replica exits, every call answers within its deadline. The longest grant gap at each
  fault is printed next to etcd's election timeout.
- 2 of 3 members lost: typed UNAVAILABLE at once, no hang; one back (quorum), and service
  resumes by itself with the hold and the queue as they were.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
from aetcd.rpc import rpc_pb2 as pb

from tests.conftest import ClusterFactory
from tests.faults.etcd_load import (
    Cycle,
    Load,
    grants_after,
    longest_gap,
    restored,
    run_job,
    timed,
)
from tests.faults.harness import check_switches, describe, report_recovery
from timeslice import AsyncTimeSliceClient, Grant, register
from timeslice.errors import Timeout, Unavailable
from timeslice.tls import TlsFiles
from timeslice_orchestrator.store.etcd import (
    EtcdClient,
    LeaseKeeper,
    StoreUnavailable,
    WatchBatch,
    parse_endpoints,
)
from timeslice_orchestrator.store.follower import WATCH_STUCK_AFTER
from timeslice_tools.dev.certs import Pki
from timeslice_tools.dev.etcd import EtcdCluster
from timeslice_tools.history import (
    check_fifo,
    check_mutual_exclusion,
    check_nothing_lost,
)

FAST_SIM = ["--sim-state-gb", "0.25"]
JOBS = ["a", "b", "c", "d"]
CALL_TIMEOUT = 5.0  # the SDK's bound on each unary call
ACQUIRE_TIMEOUT = 20.0
PAUSE = 10.0
T = TypeVar("T")


# -- endpoints ---------------------------------------------------------------------------------


def test_endpoints_parse_ip_addresses_dns_names_and_urls() -> None:
    assert parse_endpoints(["127.0.0.1:2379"]) == ["127.0.0.1:2379"]
    assert parse_endpoints(["localhost:1,localhost:2", " etcd-2.etcd:2379 "]) == [
        "localhost:1",
        "localhost:2",
        "etcd-2.etcd:2379",
    ]
    assert parse_endpoints(["https://etcd-0:2379/", "http://[::1]:2379"]) == [
        "etcd-0:2379",
        "[::1]:2379",
    ]
    for bad in (["localhost"], ["host:port"], ["::1:2379"], [","], [], ["h:0"], ["h:70000"]):
        with pytest.raises(ValueError):
            parse_endpoints(bad)


# -- the store client on a 3-member cluster ----------------------------------------------------


@pytest.fixture(scope="module", params=["plaintext", "tls"])
def etcd3(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EtcdCluster]:
    pki = Pki.create(tmp_path_factory.mktemp("pki3")) if request.param == "tls" else None
    cluster = EtcdCluster(3, tmp_path_factory.mktemp("etcd3"), tls=pki)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


def _by_name(cluster: EtcdCluster) -> list[str]:
    """The members as ``localhost:PORT``: DNS names, checked against the certificate."""
    return [f"localhost:{m.client_port}" for m in cluster.members]


def _client(cluster: EtcdCluster, timeout: float = 2.0) -> EtcdClient:
    tls = None
    if cluster.tls is not None:
        pair = cluster.tls.etcd_client
        tls = TlsFiles(str(cluster.tls.etcd_ca), str(pair.cert), str(pair.key))
    return EtcdClient([",".join(_by_name(cluster))], tls=tls, timeout=timeout)


@dataclass
class _Watched:
    revisions: list[int] = field(default_factory=list)
    values: list[bytes] = field(default_factory=list)
    resumes: int = 0


async def _mirror(etcd: EtcdClient, prefix: bytes, start: int, out: _Watched) -> None:
    """What the orchestrator's mirror does: watch, and resume at the last revision + 1."""
    revision = start - 1
    while True:
        try:
            async for batch in etcd.watch_prefix(prefix, revision + 1):
                assert isinstance(batch, WatchBatch)
                for event in batch.events:
                    out.revisions.append(event.kv.mod_revision)
                    out.values.append(event.kv.value)
                # As the mirror does: a catching-up watcher's header revision runs ahead of
                # its events, so only an empty batch (progress) may move past them.
                newest = max((e.kv.mod_revision for e in batch.events), default=batch.revision)
                revision = max(revision, newest)
        except StoreUnavailable:
            out.resumes += 1
            await asyncio.sleep(0.05)


async def _writes(etcd: EtcdClient, key: bytes, count: int, written: list[bytes]) -> None:
    """Write ``count`` values one after another; a write that fails is written again (a new
    value), as the orchestrator's callers do."""
    n = 0
    while len(written) < count:
        value = f"v{n}".encode()
        n += 1
        try:
            await timed("put", etcd.timeout, etcd.put(key, value))
            written.append(value)
        except StoreUnavailable:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.01)


async def _members_view(etcd: EtcdClient, key: bytes) -> dict[str, str]:
    """Each member's own answer (a serializable read): its revision and ``key``'s mod
    revision there, so a watch that stalls says whether its member lags or its stream does."""
    view: dict[str, str] = {}
    for member in etcd._members:
        try:
            answer = await member.kv.Range(pb.RangeRequest(key=key, serializable=True), timeout=2.0)
        except Exception as exc:  # a diagnosis: any failure is part of the answer
            view[member.endpoint] = f"no answer ({exc!r:.80})"
            continue
        found = answer.kvs[0].mod_revision if answer.kvs else None
        view[member.endpoint] = f"({answer.header.revision}, {found})"
    return view


async def _put(etcd: EtcdClient, key: bytes, value: bytes) -> int:
    """Put until it succeeds (during an election a put fails, typed): its revision."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return await etcd.put(key, value)
        except StoreUnavailable:
            assert time.monotonic() < deadline, "no put succeeded within 30 s"
            await asyncio.sleep(0.05)


async def test_client_fails_over_by_dns_name(etcd3: EtcdCluster) -> None:
    etcd = _client(etcd3)
    prefix = f"/timeslice/ha/{time.monotonic_ns()}/".encode()
    key = prefix + b"k"
    async with restored(etcd3):
        start = await etcd.put(prefix + b"start", b"")
        watched = _Watched()
        watcher = asyncio.create_task(_mirror(etcd, prefix, start + 1, watched))
        # The replicas' default TTL: a refresh that hangs on the paused member, then an
        # election if that member led, must both fit in it.
        lease = await etcd.grant_lease(5)
        keeper = LeaseKeeper(etcd, lease, 5)
        keeping = asyncio.create_task(keeper.run())
        written: list[bytes] = []
        writer = asyncio.create_task(_writes(etcd, key, 10**9, written))
        try:
            for fault in ("kill", "pause"):
                await asyncio.sleep(0.5)
                current = _by_name(etcd3).index(etcd.current_endpoint)
                before = len(written)
                if fault == "kill":
                    await asyncio.to_thread(etcd3.kill, current)
                else:
                    etcd3.pause(current)
                # Reads answer within their deadline (on another member), writes go on.
                # While a new leader is elected (the member led) no member can serve one:
                # then a read fails, typed, within its deadline, and a later one answers.
                answered, deadline = 0, time.monotonic() + 15
                while answered < 5:
                    assert time.monotonic() < deadline, f"reads failed after the {fault}"
                    try:
                        kv = await timed("get", etcd.timeout, etcd.get(key))
                    except StoreUnavailable:
                        await asyncio.sleep(0.05)
                        continue
                    assert kv is not None
                    answered += 1
                deadline = time.monotonic() + 15
                while len(written) < before + 10:
                    assert time.monotonic() < deadline, f"writes stalled after the {fault}"
                    await asyncio.sleep(0.05)
                assert etcd.current_endpoint != _by_name(etcd3)[current]
                # A keepalive stream on that member moves too: the lease is never lost.
                await asyncio.sleep(3.5)
                assert not keeper.lost.is_set(), f"the lease was lost after the {fault}"
                assert await etcd.lease_ttl(lease) > 0
                if fault == "pause":
                    etcd3.resume(current)
                else:
                    await asyncio.to_thread(etcd3.start_member, current)
            writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            # The watch saw every write once, in order, across its resumes.
            final = await etcd.put(prefix + b"end", b"")
            deadline = time.monotonic() + 30
            heard, moving_since, passed_over = len(watched.revisions), time.monotonic(), 0
            while not watched.revisions or watched.revisions[-1] < final:
                if len(watched.revisions) > heard:
                    heard, moving_since = len(watched.revisions), time.monotonic()
                elif time.monotonic() - moving_since >= WATCH_STUCK_AFTER:
                    # As the replica's mirror does with a watch that brings back none of its
                    # own writes (store/follower.py): its member is passed over and the watch
                    # resumes on another. A resumed watch that answers progress requests but
                    # delivers no events was seen twice under load (run 10 of a clean-clone
                    # series on 8680b09 here: nothing after revision 40 for 30 s).
                    etcd.pass_over_watch_member("the test's watch is behind its last write")
                    moving_since, passed_over = time.monotonic(), passed_over + 1
                if time.monotonic() >= deadline:
                    members = await _members_view(etcd, prefix + b"end")
                    raise AssertionError(
                        f"the watch did not catch up to {final}: last event "
                        f"{watched.revisions[-1:]}, {watched.resumes} resumes, current member "
                        f"{etcd.current_endpoint}, watching {etcd._watching}; each member's "
                        f"own view (revision, the end key's mod revision): {members}"
                    )
                await asyncio.sleep(0.05)
            assert watched.revisions == sorted(set(watched.revisions)), "a duplicate event"
            seen = [v for v in watched.values if v.startswith(b"v")]
            assert [v for v in seen if v in set(written)] == written, "a write the watch missed"
            assert watched.resumes >= 1, "the watch never had to move"
            if passed_over:
                print(f"the watch was behind its last write and passed over {passed_over} times")
        finally:
            for task in (watcher, keeping, writer):
                task.cancel()
            await asyncio.gather(watcher, keeping, writer, return_exceptions=True)
            await etcd.close()


async def test_a_watch_on_a_paused_member_moves_while_nothing_else_calls_it(
    etcd3: EtcdCluster,
) -> None:
    # The mirror's watch can sit on a member its unary calls no longer use (they moved at an
    # earlier fault). A paused member answers nothing, and gRPC's keepalive stops pinging a
    # connection that sends no data, so only the client itself can find the watch silent.
    watching, writing = _client(etcd3), _client(etcd3)
    prefix = f"/timeslice/ha/{time.monotonic_ns()}/".encode()
    async with restored(etcd3):
        start = await _put(writing, prefix + b"start", b"")
        watched = _Watched()
        watcher = asyncio.create_task(_mirror(watching, prefix, start + 1, watched))
        try:
            first = await _put(writing, prefix + b"k", b"before")
            while not watched.revisions or watched.revisions[-1] < first:
                await asyncio.sleep(0.02)
            member = _by_name(etcd3).index(watching.current_endpoint)
            if _by_name(etcd3).index(writing.current_endpoint) == member:
                writing._current = (member + 1) % 3  # the writer stays away from it
            etcd3.pause(member)
            paused = time.monotonic()
            later = await _put(writing, prefix + b"k", b"during")
            while not watched.revisions or watched.revisions[-1] < later:
                assert time.monotonic() - paused < 8.0, (
                    f"the watch on the paused member saw nothing for 8 s "
                    f"({watched.resumes} resumes)"
                )
                await asyncio.sleep(0.05)
            report_recovery("etcd member paused: its watch moved after", time.monotonic() - paused)
            assert watched.resumes >= 1
        finally:
            etcd3.resume(member)
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await watching.close()
            await writing.close()


async def test_a_call_to_a_cluster_without_quorum_is_a_typed_unavailable(
    etcd3: EtcdCluster,
) -> None:
    etcd = _client(etcd3, timeout=1.5)
    key = f"/timeslice/ha/{time.monotonic_ns()}".encode()
    async with restored(etcd3):
        await etcd.put(key, b"before")
        await asyncio.to_thread(etcd3.kill, 0)
        await asyncio.to_thread(etcd3.kill, 1)
        for call in (etcd.get(key), etcd.put(key, b"during"), etcd.grant_lease(5)):
            with pytest.raises(StoreUnavailable):
                await timed("a call without quorum", etcd.timeout, call)
        await asyncio.to_thread(etcd3.start_member, 0)
        deadline = time.monotonic() + 20
        while True:
            try:
                kv = await etcd.get(key)
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline, "etcd did not come back with quorum"
                await asyncio.sleep(0.1)
        # The put without quorum failed typed, yet may land once quorum returns (the surviving
        # member kept the proposal in its log): a write that timed out may have been applied,
        # which is why callers guard their retries with compares. Nothing else may be there.
        assert kv is not None and kv.value in (b"before", b"during"), kv
        await etcd.close()


# -- the service on a 3-member cluster ---------------------------------------------------------


@pytest.mark.slow
async def test_leader_killed_restarted_and_follower_paused_under_load(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(replicas=2, agents=1, etcd_members=3, agent_args=FAST_SIM)
    etcd = cluster.etcd_cluster
    assert etcd is not None
    socket = str(cluster.agent_sockets["node-0"])
    workers = [register("g", job_id=j, socket=socket) for j in JOBS]
    load = Load()
    faults: dict[str, tuple[float, float]] = {}
    try:
        clients = [
            AsyncTimeSliceClient(cluster.targets, job_id=j, call_timeout=CALL_TIMEOUT) for j in JOBS
        ]
        runs = [
            asyncio.create_task(run_job(c, load, Cycle("g", ACQUIRE_TIMEOUT, CALL_TIMEOUT)))
            for c in clients
        ]
        await grants_after(load, 0.0, 12, 60, "to warm up")

        leader = await asyncio.to_thread(etcd.wait_for_leader)
        killed = time.monotonic()
        await asyncio.to_thread(etcd.kill, leader)
        new_leader = await asyncio.to_thread(etcd.wait_for_leader, 30.0, not_=leader)
        elected = time.monotonic()
        await grants_after(load, elected, 8, 30, "after the leader was killed")
        faults["leader killed"] = (killed, time.monotonic())
        report_recovery("etcd leader killed: new leader after", elected - killed)

        restarted = time.monotonic()
        await asyncio.to_thread(etcd.start_member, leader)
        await grants_after(load, time.monotonic(), 8, 30, "after the old leader restarted")
        faults["old leader restarted"] = (restarted, time.monotonic())

        follower = next(i for i in range(3) if i != new_leader and i != leader)
        paused = time.monotonic()
        etcd.pause(follower)
        try:
            await asyncio.sleep(PAUSE)
        finally:
            etcd.resume(follower)
        resumed = time.monotonic()
        await grants_after(load, resumed, 8, 30, "after the follower resumed")
        faults["follower paused 10 s"] = (paused, time.monotonic())
        grants_in_pause = sum(paused < h.granted_at < resumed for h in load.recorder.holds)

        load.stop.set()
        try:
            await asyncio.wait_for(asyncio.gather(*runs), ACQUIRE_TIMEOUT + 3 * CALL_TIMEOUT)
        except TimeoutError:
            stuck = await describe(cluster, "g", 60)
            raise AssertionError("a job did not finish\n" + stuck) from None
        for c in clients:
            await c.close()
    finally:
        load.stop.set()
        for w in workers:
            w.close()
    holds, attempts = load.recorder.holds, load.recorder.attempts
    check_mutual_exclusion(holds)
    check_fifo(holds)
    granted = Counter(h.job for h in holds)
    check_nothing_lost(attempts, {j: granted[j] for j in JOBS})
    assert all(granted[j] > 0 for j in JOBS), granted
    check_switches(cluster)
    assert not {n for n in cluster.exited() if not n.startswith("etcd")}, cluster.exited()
    # Each fault's longest grant gap, next to etcd's election timeout.
    lines = []
    for name, (start, end) in faults.items():
        gap = longest_gap(holds, start, end)
        ratio = gap / etcd.election_timeout
        lines.append(f"{name}: longest grant gap {gap:.2f} s ({ratio:.1f}x election timeout)")
        report_recovery(f"etcd ha, {name}: longest grant gap", gap)
    print(
        f"\netcd election timeout {etcd.election_timeout:g} s; grants {len(holds)}, "
        f"{grants_in_pause} during the pause; typed errors {dict(load.errors)}\n" + "\n".join(lines)
    )
    assert grants_in_pause > 0, "no grant while a follower was paused"


@pytest.mark.slow
async def test_quorum_lost_then_back_keeps_hold_and_queue(
    cluster_factory: ClusterFactory, tmp_path: Path
) -> None:
    cluster = cluster_factory(replicas=2, agents=1, etcd_members=3, agent_args=FAST_SIM)
    etcd = cluster.etcd_cluster
    assert etcd is not None
    socket = str(cluster.agent_sockets["node-0"])
    workers = [register("g", job_id=j, socket=socket) for j in JOBS]
    clients = {
        j: AsyncTimeSliceClient(cluster.targets, job_id=j, call_timeout=CALL_TIMEOUT) for j in JOBS
    }
    waits: list[asyncio.Task[Grant]] = []
    try:
        holder = await clients["a"].acquire("g", timeout=30)
        for j in ("b", "c"):
            waits.append(asyncio.create_task(clients[j].acquire("g", timeout=120)))
            while len((await clients["a"].status("g")).queue) < len(waits):
                await asyncio.sleep(0.05)
        before = await clients["a"].status("g")
        assert before.holder_job_id == "a" and [e.job_id for e in before.queue] == ["b", "c"]

        leader = await asyncio.to_thread(etcd.wait_for_leader)
        lost = [leader, (leader + 1) % 3]
        for i in lost:
            await asyncio.to_thread(etcd.kill, i)
        down = time.monotonic()
        # No quorum: a new acquire and a status read fail typed, within their deadlines.
        # (An acquire gives up typed too: Unavailable, or Timeout when its wait ran out first.)
        with pytest.raises((Unavailable, Timeout)):
            await timed(
                "acquire without quorum", 2 * CALL_TIMEOUT, clients["d"].acquire("g", timeout=3)
            )
        # A status read answers from the replica's mirror (as it last saw etcd) or fails
        # typed; either way within its deadline.
        for _ in range(2):
            with contextlib.suppress(Unavailable):
                await timed("status without quorum", CALL_TIMEOUT, clients["d"].status("g"))
        await asyncio.sleep(max(0.0, 3.0 - (time.monotonic() - down)))

        back = time.monotonic()
        await asyncio.to_thread(etcd.start_member, lost[0])
        await asyncio.to_thread(etcd.wait_for_leader)
        deadline = time.monotonic() + 30
        while True:
            try:
                after = await clients["a"].status("g")
                if after.holder_job_id:
                    break
            except Unavailable:
                pass
            assert time.monotonic() < deadline, "service did not resume with quorum"
            await asyncio.sleep(0.1)
        report_recovery("etcd quorum back: status answers after", time.monotonic() - back)
        assert after.holder_job_id == "a" and after.holder_epoch == before.holder_epoch
        assert [e.job_id for e in after.queue] == ["b", "c"], after.queue
        # The queue is served in order once the holder yields.
        await clients["a"].yield_("g")
        try:
            got_b = await asyncio.wait_for(waits[0], 60)
        except TimeoutError:  # seen once (1 run in ~30): which part stopped?
            stuck = await describe(cluster, "g", 60)
            raise AssertionError("b was not granted within 60 s of a's yield\n" + stuck) from None
        assert got_b.epoch > holder.epoch
        await clients["b"].yield_("g")
        await asyncio.wait_for(waits[1], 60)
        await clients["c"].yield_("g")
        assert not {n for n in cluster.exited() if not n.startswith("etcd")}, cluster.exited()
        await asyncio.to_thread(etcd.start_member, lost[1])
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        for c in clients.values():
            await c.close()
        for w in workers:
            w.close()
