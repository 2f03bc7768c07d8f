"""The store's etcd v3 client, cut as etcd's own client is: the data model and transaction DSL
(:mod:`.ops`), the typed errors (:mod:`.errors`), the members and the calls' failover
(:mod:`.members`), leases (:mod:`.leases`), watches (:mod:`.watch`), and
:class:`~.client.EtcdClient`, which composes them with the key-value calls.

The names below are the package's public surface; import them from here.
"""

from timeslice_orchestrator.store.etcd.client import EtcdClient
from timeslice_orchestrator.store.etcd.errors import (
    Compacted,
    EtcdRewound,
    LeaseExpired,
    MustRelist,
    StoreError,
    StoreUnavailable,
    WatchCompacted,
    WatchTooLarge,
)
from timeslice_orchestrator.store.etcd.leases import LeaseKeeper
from timeslice_orchestrator.store.etcd.members import MemberProbe, parse_endpoints
from timeslice_orchestrator.store.etcd.ops import (
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    Get,
    KeyValue,
    Op,
    Put,
    Txn,
    TxnResult,
    absent,
    created_at,
    modified_at,
    none_under,
    prefix_end,
    present,
    value_is,
)
from timeslice_orchestrator.store.etcd.watch import EventType, WatchBatch, WatchEvent

__all__ = [
    "Compacted",
    "Compare",
    "CompareOp",
    "CompareTarget",
    "Delete",
    "EtcdClient",
    "EtcdRewound",
    "EventType",
    "Get",
    "KeyValue",
    "LeaseExpired",
    "LeaseKeeper",
    "MemberProbe",
    "MustRelist",
    "Op",
    "Put",
    "StoreError",
    "StoreUnavailable",
    "Txn",
    "TxnResult",
    "WatchBatch",
    "WatchCompacted",
    "WatchEvent",
    "WatchTooLarge",
    "absent",
    "created_at",
    "modified_at",
    "none_under",
    "parse_endpoints",
    "prefix_end",
    "present",
    "value_is",
]
