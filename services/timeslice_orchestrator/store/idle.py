"""Removing an idle group: every key under ``groups/<group>/``, in one guarded transaction.

The guard is one compare over the group's whole key range: every key there has a mod
revision at most the one the caller judged the group idle at. A key written since (a new
queue entry, a hold, residency reported by an agent, a driver claiming the group) makes it
fail and nothing is deleted, so several replicas may sweep at once: one deletes, the others'
compares fail (or find the range already empty, and delete nothing).
"""

from __future__ import annotations

from timeslice_orchestrator.store.base import StoreBase
from timeslice_orchestrator.store.etcd import (
    Compare,
    CompareOp,
    CompareTarget,
    Delete,
    Txn,
    prefix_end,
)


class IdleStore(StoreBase):
    async def remove_idle_group(self, group: str, revision: int) -> bool:
        """Delete ``group``'s keys if none changed after ``revision``; whether it did."""
        root = self.keys.group_root(group)
        unchanged = Compare(
            root, CompareTarget.MOD, CompareOp.LESS, revision + 1, range_end=prefix_end(root)
        )
        result = await self.etcd.txn(Txn([unchanged], [Delete(root, prefix=True)]))
        return result.succeeded
