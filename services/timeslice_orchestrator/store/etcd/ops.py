"""etcd's data model and transaction DSL: key-values, typed compares and operations, and
their translation to etcd's protocol messages."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from aetcd.rpc import rpc_pb2 as pb


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


class CompareTarget(enum.Enum):
    VERSION = pb.Compare.VERSION
    CREATE = pb.Compare.CREATE
    MOD = pb.Compare.MOD
    VALUE = pb.Compare.VALUE
    LEASE = pb.Compare.LEASE


class CompareOp(enum.Enum):
    EQUAL = pb.Compare.EQUAL
    NOT_EQUAL = pb.Compare.NOT_EQUAL
    GREATER = pb.Compare.GREATER
    LESS = pb.Compare.LESS


@dataclass(frozen=True, slots=True)
class Compare:
    key: bytes
    target: CompareTarget
    op: CompareOp
    value: int | bytes
    # With a range end, every key in [key, range_end) must pass; an empty range compares as
    # one absent key (version, revisions and lease 0), so it passes ``absent``.
    range_end: bytes = b""

    def to_pb(self) -> pb.Compare:
        msg = pb.Compare(
            key=self.key, target=self.target.value, result=self.op.value, range_end=self.range_end
        )
        if self.target is CompareTarget.VALUE:
            assert isinstance(self.value, bytes)
            msg.value = self.value
        elif self.target is CompareTarget.VERSION:
            msg.version = int(self.value)
        elif self.target is CompareTarget.CREATE:
            msg.create_revision = int(self.value)
        elif self.target is CompareTarget.MOD:
            msg.mod_revision = int(self.value)
        else:
            msg.lease = int(self.value)
        return msg


def absent(key: bytes) -> Compare:
    return Compare(key, CompareTarget.VERSION, CompareOp.EQUAL, 0)


def none_under(prefix: bytes) -> Compare:
    """No key starts with ``prefix``."""
    return Compare(prefix, CompareTarget.VERSION, CompareOp.EQUAL, 0, prefix_end(prefix))


def present(key: bytes) -> Compare:
    return Compare(key, CompareTarget.VERSION, CompareOp.GREATER, 0)


def created_at(key: bytes, revision: int) -> Compare:
    return Compare(key, CompareTarget.CREATE, CompareOp.EQUAL, revision)


def modified_at(key: bytes, revision: int) -> Compare:
    return Compare(key, CompareTarget.MOD, CompareOp.EQUAL, revision)


def value_is(key: bytes, value: bytes) -> Compare:
    return Compare(key, CompareTarget.VALUE, CompareOp.EQUAL, value)


@dataclass(frozen=True, slots=True)
class Put:
    key: bytes
    value: bytes
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    key: bytes
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Get:
    key: bytes
    prefix: bool = False


@dataclass(frozen=True, slots=True)
class Txn:
    compare: Sequence[Compare]
    success: Sequence[Op] = ()
    failure: Sequence[Op] = ()


Op = Put | Delete | Get | Txn


@dataclass(slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    # One list of key-values per Get op of the branch that ran, in order.
    reads: list[list[KeyValue]] = field(default_factory=list)


def prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key with ``prefix``."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _kv(msg: object) -> KeyValue:
    return KeyValue(
        key=msg.key,  # type: ignore[attr-defined]
        value=msg.value,  # type: ignore[attr-defined]
        create_revision=msg.create_revision,  # type: ignore[attr-defined]
        mod_revision=msg.mod_revision,  # type: ignore[attr-defined]
        version=msg.version,  # type: ignore[attr-defined]
        lease=msg.lease,  # type: ignore[attr-defined]
    )


def _op_to_pb(op: Op) -> pb.RequestOp:
    if isinstance(op, Put):
        return pb.RequestOp(request_put=pb.PutRequest(key=op.key, value=op.value, lease=op.lease))
    if isinstance(op, Delete):
        req = pb.DeleteRangeRequest(key=op.key)
        if op.prefix:
            req.range_end = prefix_end(op.key)
        return pb.RequestOp(request_delete_range=req)
    if isinstance(op, Get):
        get = pb.RangeRequest(key=op.key)
        if op.prefix:
            get.range_end = prefix_end(op.key)
        return pb.RequestOp(request_range=get)
    return pb.RequestOp(request_txn=_txn_to_pb(op))


def _reads_only(txn: Txn) -> bool:
    """The transaction writes nothing, whichever branch runs: it may be sent again."""
    return all(
        isinstance(op, Get) or (isinstance(op, Txn) and _reads_only(op))
        for op in (*txn.success, *txn.failure)
    )


def _txn_to_pb(txn: Txn) -> pb.TxnRequest:
    return pb.TxnRequest(
        compare=[c.to_pb() for c in txn.compare],
        success=[_op_to_pb(o) for o in txn.success],
        failure=[_op_to_pb(o) for o in txn.failure],
    )
