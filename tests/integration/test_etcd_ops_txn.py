"""etcd's transaction DSL (store/etcd/ops.py) against a real etcd: compares, nested
transactions and the reads of the branch that ran."""

from __future__ import annotations

import uuid

from timeslice_orchestrator.store.etcd import (
    Delete,
    EtcdClient,
    Get,
    Put,
    Txn,
    absent,
)


def unique() -> bytes:
    return f"/test/{uuid.uuid4().hex}/".encode()


async def test_txn_create_if_absent_and_reads(etcd: EtcdClient) -> None:
    p = unique()
    first = await etcd.txn(Txn([absent(p + b"k")], [Put(p + b"k", b"1")], [Get(p + b"k")]))
    assert first.succeeded
    second = await etcd.txn(Txn([absent(p + b"k")], [Put(p + b"k", b"2")], [Get(p + b"k")]))
    assert not second.succeeded
    assert second.reads[0][0].value == b"1"
    assert second.reads[0][0].create_revision == first.revision
    nested = await etcd.txn(
        Txn([absent(p + b"x")], [Txn([absent(p + b"y")], [Put(p + b"y", b"n")]), Delete(p + b"k")])
    )
    assert nested.succeeded
    assert (await etcd.get(p + b"y")) is not None and (await etcd.get(p + b"k")) is None
