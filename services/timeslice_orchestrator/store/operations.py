"""Operator operations: a node's request to snapshot or restore one job, and its outcome.

The record (``groups/<group>/operations/<id>``, :class:`.records.OperationRecord`) is written
PENDING by the request, on a lease of its own whose TTL is the retention: it expires that long
after the request whatever its state, so records never pile up and nobody has to sweep them.
The driver begins it with the switch record that carries it out (RUNNING, same transaction,
:meth:`.switches.SwitchStore.begin_switch`) and closes it with that switch
(:meth:`.switches.SwitchStore.end_switch`), or at once here (:meth:`finish_operation`) when
nothing has to move or the group no longer allows it.
"""

from __future__ import annotations

import hashlib
import uuid

from timeslice_orchestrator.store.base import StoreBase
from timeslice_orchestrator.store.etcd import Get, Put, Txn, absent, modified_at, present
from timeslice_orchestrator.store.records import OperationRecord, Stored
from timeslice_orchestrator.store.switches import Authority, SwitchStore


def new_operation_id() -> str:
    """A fresh operation id: ``op-`` and 24 hex digits (a valid key part)."""
    return f"op-{uuid.uuid4().hex[:24]}"


def operation_id_for(node: str, group: str, request_id: str) -> str:
    """The operation id of a request carrying an idempotency key: every retry of it (same
    node, group and ``request_id``) names the same record, on whichever replica it lands."""
    digest = hashlib.sha256("\0".join((node, group, request_id)).encode()).hexdigest()
    return f"op-{digest[:24]}"


class OperationStore(StoreBase):
    """Record operator operations and close the ones that need no switch."""

    async def request_operation(
        self, record: OperationRecord, retention: int
    ) -> Stored[OperationRecord] | None:
        """Write a PENDING operation on a new lease of ``retention`` seconds.

        When a record of that id exists already (a retry of the same request, recorded by an
        earlier attempt), that record is returned and nothing is written. None when the group
        disappeared meanwhile (its meta key is compared): an operation never brings a group
        into existence.
        """
        k = self.keys
        key = k.operation(record.group, record.operation_id)
        lease = await self.etcd.grant_lease(retention)
        result = await self.etcd.txn(
            Txn(
                [absent(key), present(k.meta(record.group))],
                [Put(key, record.encode(), lease=lease), Get(key)],
                [Get(key)],
            )
        )
        if not result.succeeded:
            await self.etcd.revoke_lease(lease)
            existing = result.reads[0]
            if existing:
                return Stored.of(existing[0], OperationRecord.decode(existing[0].value))
            return None
        return Stored.of(result.reads[0][0], record)

    async def operation(self, group: str, operation_id: str) -> Stored[OperationRecord] | None:
        """The operation record as etcd has it now (None: unknown, or expired)."""
        kv = await self.etcd.get(self.keys.operation(group, operation_id))
        return Stored.of(kv, OperationRecord.decode(kv.value)) if kv is not None else None

    async def finish_operation(
        self, auth: Authority, operation: Stored[OperationRecord], outcome: OperationRecord
    ) -> int | None:
        """Write the outcome of an operation that needed no switch; None if the record or the
        driver role changed meanwhile (the pass looks again)."""
        k = self.keys
        group = outcome.group
        key = k.operation(group, outcome.operation_id)
        result = await self.etcd.txn(
            Txn(
                [SwitchStore.driving(k, group, auth), modified_at(key, operation.mod_revision)],
                [Put(key, outcome.encode(), lease=operation.lease)],
            )
        )
        return result.revision if result.succeeded else None
