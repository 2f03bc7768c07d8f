"""Group commit against a real etcd: transactions of different groups share requests, each
keeps its own answer, one group's never share, and a refused part does not sink the rest."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from timeslice_orchestrator.store.etcd import (
    EtcdClient,
    Get,
    LeaseExpired,
    Put,
    StoreUnavailable,
    Txn,
    absent,
)
from timeslice_tools.dev.etcd import EtcdServer


def unique() -> bytes:
    return f"/batch/{uuid.uuid4().hex}/".encode()


async def test_concurrent_groups_share_requests_and_keep_their_own_answers(
    etcd: EtcdClient,
) -> None:
    p = unique()
    taken = p + b"g3/k"
    await etcd.put(taken, b"before")
    counts = etcd.batcher
    requests, txns = counts.requests_sent, counts.txns_sent

    async def create(i: int) -> tuple[int, bool, list[bytes]]:
        key = p + f"g{i}/k".encode()
        result = await etcd.txn(
            Txn([absent(key)], [Put(key, f"v{i}".encode())], [Get(key)]), batch=f"g{i}"
        )
        return i, result.succeeded, [kv.value for read in result.reads for kv in read]

    answers = await asyncio.gather(*(create(i) for i in range(40)))
    for i, succeeded, reads in answers:
        if i == 3:
            assert not succeeded and reads == [b"before"]  # its own failure branch's read
        else:
            assert succeeded and reads == []
            kv = await etcd.get(p + f"g{i}/k".encode())
            assert kv is not None and kv.value == f"v{i}".encode()
    sent = counts.requests_sent - requests
    assert counts.txns_sent - txns == 40
    # 40 at once with 2 requests out: all but the first two waited and went together.
    assert sent < 40, f"{sent} requests for 40 transactions: nothing was batched"


async def test_one_groups_transactions_never_share_a_request(etcd: EtcdClient) -> None:
    """Two entries of one group in one request would get one revision: one ticket for two
    places in line. Each gets its own."""
    p = unique()

    async def enqueue(i: int) -> int:
        key = p + f"queue/job-{i}".encode()
        result = await etcd.txn(Txn([absent(key)], [Put(key, b"w")]), batch="one-group")
        assert result.succeeded
        return result.revision

    revisions = await asyncio.gather(*(enqueue(i) for i in range(20)))
    assert len(set(revisions)) == 20, sorted(revisions)


async def test_compares_of_one_group_still_exclude_each_other(etcd: EtcdClient) -> None:
    """Twenty callers race for one key: exactly one wins, as without batching."""
    p = unique()
    holder = p + b"holder"

    async def take(i: int) -> bool:
        result = await etcd.txn(
            Txn([absent(holder)], [Put(holder, f"job-{i}".encode())]), batch="the-group"
        )
        return result.succeeded

    wins = await asyncio.gather(*(take(i) for i in range(20)))
    assert sum(wins) == 1


async def test_a_refused_part_fails_alone(etcd: EtcdClient) -> None:
    """A put on a lease that is gone makes etcd refuse the whole request: each transaction is
    sent again alone, so only that one fails."""
    p = unique()
    lease = await etcd.grant_lease(30)
    await etcd.revoke_lease(lease)
    gate = asyncio.Event()

    async def put(i: int) -> bool:
        await gate.wait()
        key = p + f"g{i}".encode()
        try:
            await etcd.txn(Txn([], [Put(key, b"x", lease=lease if i == 5 else 0)]), batch=f"g{i}")
        except LeaseExpired:
            return False
        return True

    tasks = [asyncio.ensure_future(put(i)) for i in range(12)]
    await asyncio.sleep(0)
    gate.set()
    done = await asyncio.gather(*tasks)
    assert done == [i != 5 for i in range(12)]
    for i in range(12):
        assert (await etcd.get(p + f"g{i}".encode()) is None) == (i == 5)


async def test_a_transaction_queued_behind_a_stalled_etcd_waits_no_longer_than_alone(
    tmp_path: Path,
) -> None:
    """etcd stops answering (SIGSTOP) with two requests out and more transactions queued
    behind them: every caller hears within about one deadline of asking, not two."""
    with EtcdServer(tmp_path / "etcd") as server:
        etcd = EtcdClient([server.endpoint], timeout=2.0)
        try:
            await etcd.put(b"/warm", b"up")
            server.pause()
            try:

                async def put(i: int) -> float:
                    asked = time.monotonic()
                    with pytest.raises(StoreUnavailable):
                        await etcd.txn(Txn([], [Put(f"/g{i}".encode(), b"x")]), batch=f"g{i}")
                    return time.monotonic() - asked

                waits = await asyncio.gather(*(put(i) for i in range(6)))
            finally:
                server.resume()
            assert max(waits) < 3.0, waits  # two deadlines would be 4 s
        finally:
            await etcd.close()
