"""A yield hands the group over in one transaction only where every replica understands it.

Real replicas on a real etcd. A new deployment starts with the feature on; one upgraded from
an older version (its keyspace already has keys when the replicas start) starts with it off,
until an operator runs ``python -m timeslice_orchestrator features enable``; ``disable`` turns
it off again (before a rollback). Which way a hand-over went shows in etcd: in one
transaction the holder key is overwritten (its create revision stays the previous hold's
epoch), in two it is deleted and created again; each replica's metrics say which features its
mirror sees and how it handed over.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid

from tests.conftest import ClusterFactory
from tests.e2e.test_metrics_live import scrape, total, value
from timeslice import AsyncTimeSliceClient
from timeslice_orchestrator.store.etcd import EtcdClient
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_tools.dev.cluster import LocalCluster


def _features(cluster: LocalCluster, action: str) -> str:
    """Run the operator command as a person would, with the replicas' etcd flags."""
    tls = cluster.etcd_tls
    assert tls is not None and tls.cert is not None and tls.key is not None
    argv = [
        sys.executable, "-m", "timeslice_orchestrator", "features", action,
        "--etcd", cluster.etcd_endpoint, "--prefix", cluster.prefix,
        "--etcd-ca", tls.ca, "--etcd-cert", tls.cert, "--etcd-key", tls.key,
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


async def _hand_over(
    holder: AsyncTimeSliceClient, waiter: AsyncTimeSliceClient, epoch: int, etcd: EtcdClient,
    keys: Keyspace,
) -> tuple[int, bool]:  # fmt: skip
    """``holder`` (holding under ``epoch``) yields while ``waiter`` waits; returns the
    waiter's epoch and whether the hold was handed over in one transaction."""
    waiting = asyncio.create_task(waiter.acquire("g", timeout=30))
    async with asyncio.timeout(30):
        while [q.job_id for q in (await holder.status("g")).queue] != [waiter.job_id]:
            await asyncio.sleep(0.02)
    await holder.yield_("g")
    grant = await waiting
    assert grant.epoch > epoch
    kv = await etcd.get(keys.holder("g"))
    assert kv is not None and kv.mod_revision == grant.epoch
    async with asyncio.timeout(10):  # its replica's mirror shows it too (it may lag the grant)
        while (await waiter.status("g")).holder_epoch != grant.epoch:
            await asyncio.sleep(0.02)
    return grant.epoch, kv.create_revision != grant.epoch


def _seen_by_every_replica(cluster: LocalCluster, on: bool) -> None:
    """Until every replica's mirror shows the feature ``on`` (or off)."""
    deadline = time.monotonic() + 15
    feature = "one_transaction_hand_over"
    while True:
        seen = [
            value(scrape(http), "timeslice_feature_enabled", feature=feature)
            for http in cluster.replica_http
        ]
        if seen == [1.0 if on else 0.0] * len(seen):
            return
        assert time.monotonic() < deadline, f"replicas see {feature} as {seen}"
        time.sleep(0.05)


def _hand_overs_counted(cluster: LocalCluster) -> dict[str, float]:
    """Hand-overs made so far, by transactions taken, over every replica."""
    samples = [s for http in cluster.replica_http for s in scrape(http)]
    return {n: total(samples, "timeslice_hand_overs_total", transactions=n) for n in ("one", "two")}


async def _hand_overs(
    cluster: LocalCluster, expected: list[tuple[str | None, bool]]
) -> dict[str, str]:
    """Jobs a and b hand the group back and forth; before each hand-over, the operator
    command of ``expected`` (if any) runs; each hand-over must go as ``expected`` says.
    Returns what each command printed."""
    printed: dict[str, str] = {}
    etcd = EtcdClient([cluster.etcd_endpoint], tls=cluster.etcd_tls)
    try:
        async with (
            AsyncTimeSliceClient(cluster.target, job_id="a") as a,
            AsyncTimeSliceClient(cluster.target, job_id="b") as b,
        ):
            epoch = (await a.acquire("g", timeout=30)).epoch
            holder, waiter = a, b
            for turn, (action, one_transaction) in enumerate(expected):
                if action is not None:
                    printed[action] = _features(cluster, action)
                    await asyncio.to_thread(_seen_by_every_replica, cluster, action == "enable")
                before = await asyncio.to_thread(_hand_overs_counted, cluster)
                epoch, in_one = await _hand_over(
                    holder, waiter, epoch, etcd, Keyspace(cluster.prefix)
                )
                assert in_one is one_transaction, f"hand-over {turn} (after {action})"
                after = await asyncio.to_thread(_hand_overs_counted, cluster)
                if one_transaction:
                    assert after["one"] == before["one"] + 1, (turn, before, after)
                else:
                    # Between the release and the grant the other replica's driver may grant
                    # first (then the yield's own grant fails its compare and counts nothing).
                    assert after["one"] == before["one"], (turn, before, after)
                holder, waiter = waiter, holder
            await holder.yield_("g")
    finally:
        await etcd.close()
    return printed


async def test_a_new_deployment_hands_over_in_one_transaction(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=0, replicas=2)
    assert "one_transaction_hand_over: on" in _features(cluster, "show")
    await asyncio.to_thread(_seen_by_every_replica, cluster, True)
    # With two replicas the waiter may wait on the other one: it learns of its grant, and
    # of its epoch, through its replica's mirror.
    printed = await _hand_overs(
        cluster, [(None, True), (None, True), ("disable", False), ("enable", True)]
    )
    # Before a rollback: disabled while a handed-over hold is live, the command says so; the
    # hand-over after it took two transactions, so at "enable" none was left.
    assert "holds an older version would misread: 1 (g)" in printed["disable"]
    assert "roll back once none is left" in printed["disable"]
    assert "holds an older version would misread: 0" in printed["enable"]
    assert "holds an older version would misread: 0" in _features(cluster, "show")


async def test_an_upgraded_deployment_hands_over_in_one_transaction_once_enabled(
    cluster_factory: ClusterFactory,
) -> None:
    prefix = f"/timeslice/upgraded-{uuid.uuid4().hex[:8]}"
    older = cluster_factory(agents=0, prefix=prefix)
    # What a deployment of an older version holds: its keys (a group), no features record.
    keys = Keyspace(prefix)
    etcd = EtcdClient([older.etcd_endpoint], tls=older.etcd_tls)
    try:
        await etcd.put(keys.meta("older"), b"")
        await etcd.delete(keys.features())
    finally:
        await etcd.close()
    older.stop()
    # Replicas of this version started on it find keys there: the feature stays off.
    cluster = cluster_factory(agents=0, prefix=prefix)
    shown = _features(cluster, "show")
    assert "one_transaction_hand_over: off" in shown and "no features record" in shown
    await _hand_overs(cluster, [(None, False), ("enable", True), (None, True)])
