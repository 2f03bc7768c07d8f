"""A yield and the next grant in one transaction: the hand-over.

A yield whose group has a waiter whose state is already where it would run ends the hold and
grants that waiter. As two transactions (release, then grant) that costs two etcd round
trips one after the other; as one, the grant overwrites the holder key instead of creating
it, so the new hold's epoch is the revision of that write, not the key's create revision
(:func:`~timeslice_orchestrator.store.records.hold_epoch`).

A replica of an older version would take the key's create revision for the new hold's epoch
(the previous hold's), so a replica hands over this way only while the deployment's
features record says that every replica understands it (docs/operations.md, "Upgrades"),
and compares that record in the transaction: switching it off takes effect at once.
"""

from __future__ import annotations

import contextlib
import dataclasses

from timeslice_orchestrator.store.base import StoreBase
from timeslice_orchestrator.store.etcd import Put, Txn, modified_at, none_under
from timeslice_orchestrator.store.keys import Kind
from timeslice_orchestrator.store.queue import Hold, check_hold, ledger_after
from timeslice_orchestrator.store.records import (
    CorruptRecord,
    FeaturesRecord,
    HolderRecord,
    Stored,
    UsageRecord,
    hold_epoch,
)
from timeslice_orchestrator.store.switches import Grant, grant_txn

# What this version understands: a new deployment starts with it (see start_features).
CURRENT_FEATURES = FeaturesRecord(one_transaction_hand_over=True)


class HandOverStore(StoreBase):
    """Release and grant in one transaction, and the features record that allows it."""

    async def start_features(self) -> bool:
        """Write :data:`CURRENT_FEATURES` if the deployment's keyspace is empty: a new
        deployment, on which no replica of an older version has run (every replica writes
        keys from its start). Returns whether it was written. A deployment upgraded from an
        older version has no record, or an older one, until an operator sets it once every
        replica runs this version (:meth:`set_features`)."""
        k = self.keys
        result = await self.etcd.txn(
            Txn([none_under(k.root)], [Put(k.features(), CURRENT_FEATURES.encode())])
        )
        return result.succeeded

    async def set_features(self, record: FeaturesRecord) -> int:
        """Write the deployment's features record; returns the revision it was written at."""
        return await self.etcd.put(self.keys.features(), record.encode())

    async def features(self) -> Stored[FeaturesRecord] | None:
        """The deployment's features record as etcd has it now (None: none written)."""
        kv = await self.etcd.get(self.keys.features())
        return Stored.of(kv, FeaturesRecord.decode(kv.value)) if kv is not None else None

    async def misread_holds(self) -> list[str]:
        """The groups whose live hold a replica of an older version would misread: one a
        hand-over wrote over the hold before it, whose epoch is not its key's create revision
        (:func:`~timeslice_orchestrator.store.records.hold_epoch`). Each ends with its job's
        next yield; before a rollback, after the feature is switched off, wait until there
        are none. A hold whose record does not decode counts too (it cannot be shown safe).
        Reads every group's keys, a page at a time, at one revision."""
        k = self.keys
        groups: list[str] = []
        async with contextlib.aclosing(self.etcd.pages(k.groups())) as pages:
            async for _, kvs in pages:
                for kv in kvs:
                    ref = k.parse(kv.key)
                    if ref is None or ref.kind is not Kind.HOLDER:
                        continue
                    try:
                        hold = Stored.of(kv, HolderRecord.decode(kv.value))
                    except CorruptRecord:
                        groups.append(ref.group)
                        continue
                    if hold_epoch(hold) != hold.create_revision:
                        groups.append(ref.group)
        return groups

    async def hand_over(
        self,
        hold: Hold,
        current: Stored[HolderRecord],
        usage: Stored[UsageRecord] | None,
        grant: Grant,
        features: Stored[FeaturesRecord],
    ) -> int | None:
        """Release ``hold`` (``current``: the hold as read) and commit ``grant`` (in place,
        by a replica that need not drive the group) at once.

        Raises as :meth:`QueueStore.release` does when ``current`` is not the hold the caller
        names. Returns the new hold's epoch, or None when a compare failed: the hold, the
        ledger, the waiter or the group changed since they were read, or the features
        record did (the caller then releases and grants apart, each reading afresh).
        """
        check_hold(hold, current)
        if not features.record.one_transaction_hand_over:
            raise ValueError("the deployment's replicas do not all understand a hand-over")
        k, group = self.keys, hold.group
        holder = dataclasses.replace(grant.holder, handed_over=True)
        handed = dataclasses.replace(grant, holder=holder)
        txn = grant_txn(k, None, handed, modified_at(k.holder(group), current.mod_revision))
        ledger = ledger_after(hold, current, usage)
        txn = Txn(
            [
                *txn.compare,
                modified_at(k.usage(group), usage.mod_revision if usage is not None else 0),
                modified_at(k.features(), features.mod_revision),
            ],
            [*txn.success, Put(k.usage(group), ledger.encode())],
        )
        # Batched: a hold's epoch is compared only within its group (never with a fence).
        result = await self.etcd.txn(txn, batch=group)
        return result.revision if result.succeeded else None
