"""Directives relayed through etcd between the driving replica and the agent's stream holder.

The driver posts ``relay/<node>/<directive>`` on its own lease (it vanishes if the driver
dies); the stream holder answers by writing the ack into the same key, unless the driver gave
up and deleted it meanwhile.
"""

from __future__ import annotations

import dataclasses

from timeslice_orchestrator.store.base import StoreBase
from timeslice_orchestrator.store.etcd import Put, Txn, absent, modified_at
from timeslice_orchestrator.store.records import RelayRecord, Stored


class RelayStore(StoreBase):
    """Post, answer and remove relayed directives."""

    async def post(self, node: str, directive_id: str, record: RelayRecord, lease: int) -> bool:
        """Post a directive on ``lease``; False if one with this ID is already in flight."""
        key = self.keys.relay(node, directive_id)
        result = await self.etcd.txn(Txn([absent(key)], [Put(key, record.encode(), lease=lease)]))
        return result.succeeded

    async def answer(
        self, node: str, directive_id: str, posted: Stored[RelayRecord], ack: str
    ) -> bool:
        """Attach the ack to the post as read, unless the driver gave up (deleted it) since."""
        key = self.keys.relay(node, directive_id)
        answered = dataclasses.replace(posted.record, ack=ack)
        result = await self.etcd.txn(
            Txn(
                [modified_at(key, posted.mod_revision)],
                [Put(key, answered.encode(), lease=posted.lease)],
            )
        )
        return result.succeeded

    async def remove(self, node: str, directive_id: str) -> None:
        """Delete the post (the driver has its ack, or gives up on it)."""
        await self.etcd.delete(self.keys.relay(node, directive_id))
