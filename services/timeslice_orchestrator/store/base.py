"""What every part of the group store shares: the etcd client and the key layout."""

from __future__ import annotations

from timeslice_orchestrator.store.etcd import EtcdClient, Put, Txn, absent
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import GroupMetaRecord


class StoreBase:
    """A part of the store: one concept's transactions over ``etcd`` and ``keys``."""

    def __init__(self, etcd: EtcdClient, keys: Keyspace) -> None:
        self.etcd = etcd
        self.keys = keys

    def _create_group(self, group: str, job: str = "") -> Txn:
        """A nested transaction that marks ``group`` as existing, unless it already does.

        ``job``: the job creating it, whose quota of groups it counts against (recorded once,
        by whoever creates the group; "" for an operator's)."""
        meta = self.keys.meta(group)
        return Txn([absent(meta)], [Put(meta, GroupMetaRecord(job).encode())])
