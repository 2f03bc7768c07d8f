"""The etcd client's leases (store/etcd/leases.py) against a real etcd: a keeper that keeps and
loses a lease, one keep-alive stream per lease, and the streams of lapsed leases closed."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from timeslice_orchestrator.store.etcd import (
    EtcdClient,
    LeaseExpired,
    LeaseKeeper,
)


def unique() -> bytes:
    return f"/test/{uuid.uuid4().hex}/".encode()


async def test_lease_keeper_keeps_and_loses(etcd: EtcdClient) -> None:
    p = unique()
    # A 3 s TTL: with 1 s, a stall of this process or of etcd on a loaded machine could lose it.
    lease = await etcd.grant_lease(3)
    await etcd.put(p + b"leased", b"v", lease=lease)
    keeper = LeaseKeeper(etcd, lease, 3)
    task = asyncio.create_task(keeper.run())
    await asyncio.sleep(7)
    assert await etcd.get(p + b"leased") is not None, "kept alive past its TTL"
    await etcd.revoke_lease(lease)
    async with asyncio.timeout(3):
        await keeper.lost.wait()
    await task
    assert await etcd.get(p + b"leased") is None
    with pytest.raises(LeaseExpired):
        await etcd.keepalive_once(lease)


async def test_keepalive_keeps_one_stream_per_lease(etcd: EtcdClient) -> None:
    opened: list[int] = []
    real = etcd._lease.LeaseKeepAlive

    def counting(*args: object, **kwargs: object) -> object:
        opened.append(1)
        return real(*args, **kwargs)

    etcd._lease.LeaseKeepAlive = counting
    first, second = await etcd.grant_lease(30), await etcd.grant_lease(30)
    for _ in range(5):
        assert await etcd.keepalive_once(first) == 30
    assert await etcd.keepalive_once(second) == 30
    assert len(opened) == 2, "a stream per refresh instead of one per lease"
    # A stream that broke while idle is replaced once, and the refresh goes through.
    etcd._keepalives[first].close()
    assert await etcd.keepalive_once(first) == 30
    assert len(opened) == 3
    # A revoked lease closes its stream; refreshing it says it is gone.
    await etcd.revoke_lease(first)
    assert first not in etcd._keepalives
    with pytest.raises(LeaseExpired):
        await etcd.keepalive_once(first)
    assert first not in etcd._keepalives


async def test_keepalive_streams_of_lapsed_leases_are_closed(etcd: EtcdClient) -> None:
    lease, other = await etcd.grant_lease(1), await etcd.grant_lease(30)
    await etcd.keepalive_once(lease)
    await asyncio.sleep(2.2)  # past its TTL and the sweep interval, refreshed nowhere
    await etcd.keepalive_once(other)
    assert lease not in etcd._keepalives
    assert other in etcd._keepalives
