"""etcd's transaction DSL (store/etcd/ops.py): prefix ranges, each compare on the field etcd
reads for its target, nested transactions, and which transactions may be sent again. What etcd
does with them is in tests/integration/test_etcd_ops_txn.py."""

from __future__ import annotations

from aetcd.rpc import rpc_pb2 as pb

from timeslice_orchestrator.store.etcd.ops import (
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    Get,
    Put,
    Txn,
    _reads_only,
    _txn_to_pb,
    absent,
    created_at,
    modified_at,
    none_under,
    prefix_end,
    present,
    value_is,
)


def test_a_prefix_ends_at_the_next_key_past_all_its_keys() -> None:
    assert prefix_end(b"/ts/groups/g/") == b"/ts/groups/g0"
    assert prefix_end(b"a\xff\xff") == b"b"  # trailing 0xff bytes carry
    assert prefix_end(b"\xff\xff") == b"\0"  # every key: etcd's "to the end"
    assert prefix_end(b"") == b"\0"


def test_each_compare_sets_the_field_its_target_reads() -> None:
    assert absent(b"k").to_pb() == pb.Compare(
        key=b"k", target=pb.Compare.VERSION, result=pb.Compare.EQUAL, version=0
    )
    assert present(b"k").to_pb().result == pb.Compare.GREATER
    assert created_at(b"k", 7).to_pb() == pb.Compare(
        key=b"k", target=pb.Compare.CREATE, result=pb.Compare.EQUAL, create_revision=7
    )
    assert modified_at(b"k", 8).to_pb().mod_revision == 8
    assert value_is(b"k", b"v").to_pb() == pb.Compare(
        key=b"k", target=pb.Compare.VALUE, result=pb.Compare.EQUAL, value=b"v"
    )
    lease = Compare(b"k", CompareTarget.LEASE, CompareOp.NOT_EQUAL, 5).to_pb()
    assert (lease.lease, lease.result) == (5, pb.Compare.NOT_EQUAL)
    # A range compare: every key under the prefix (an empty range passes ``absent``).
    under = none_under(b"p/").to_pb()
    assert (under.key, under.range_end, under.version) == (b"p/", b"p0", 0)


def test_a_nested_transaction_translates_op_by_op() -> None:
    inner = Txn([absent(b"m")], [Put(b"m", b"1")])
    msg = _txn_to_pb(
        Txn(
            [present(b"s")],
            [Put(b"q", b"e", lease=9), inner, Delete(b"g/", prefix=True)],
            [Get(b"g/", prefix=True), Get(b"s")],
        )
    )
    assert [c.key for c in msg.compare] == [b"s"]
    put, nested, delete = msg.success
    assert put.request_put == pb.PutRequest(key=b"q", value=b"e", lease=9)
    assert nested.request_txn.success[0].request_put.key == b"m"
    assert nested.request_txn.compare[0].version == 0
    assert delete.request_delete_range == pb.DeleteRangeRequest(key=b"g/", range_end=b"g0")
    ranged, single = msg.failure
    assert ranged.request_range == pb.RangeRequest(key=b"g/", range_end=b"g0")
    assert single.request_range == pb.RangeRequest(key=b"s")  # no range_end: one key


def test_only_a_transaction_that_writes_in_no_branch_may_be_sent_again() -> None:
    assert _reads_only(Txn([present(b"k")], [Get(b"k")], [Get(b"j", prefix=True)]))
    assert _reads_only(Txn([], [Txn([], [Get(b"k")])]))
    assert not _reads_only(Txn([], [Get(b"k")], [Put(b"k", b"v")]))
    assert not _reads_only(Txn([], [Txn([], [], [Delete(b"k")])]))
