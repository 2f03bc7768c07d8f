"""The group store: every transaction on sessions, queues, holds, switches and membership.

A thin facade over one class per concept, so callers hold one object:

* :mod:`.sessions` - client sessions (one lease each);
* :mod:`.queue` - enqueue, withdraw and release (Acquire and Yield);
* :mod:`.handover` - a yield that grants the next waiter in the same transaction;
* :mod:`.switches` - the driver key, switch records, grants, giving up on a waiter;
* :mod:`.members` - pinned members, agent records, residency reports;
* :mod:`.operations` - operator snapshot / restore requests and their outcomes.

Each method is one etcd transaction (or a read then one transaction) whose compares carry the
whole authority for the change: a stale replica's write fails its compare instead of landing.
Directives relayed between replicas have their own store, :class:`.relay.RelayStore`.
"""

from __future__ import annotations

from timeslice_orchestrator.store.handover import HandOverStore
from timeslice_orchestrator.store.members import MemberStore
from timeslice_orchestrator.store.operations import (
    OperationStore,
    new_operation_id,
    operation_id_for,
)
from timeslice_orchestrator.store.queue import (
    Enqueued,
    EnqueueRequest,
    FreeGroup,
    Hold,
    QueueStore,
)
from timeslice_orchestrator.store.sessions import SessionStore, lease_of, session_id_of
from timeslice_orchestrator.store.switches import (
    Authority,
    Fault,
    Grant,
    SwitchStore,
    new_switch_id,
)

__all__ = [
    "Authority",
    "EnqueueRequest",
    "Enqueued",
    "Fault",
    "FreeGroup",
    "Grant",
    "GroupStore",
    "Hold",
    "lease_of",
    "new_operation_id",
    "new_switch_id",
    "operation_id_for",
    "session_id_of",
]


class GroupStore(SessionStore, QueueStore, HandOverStore, SwitchStore, MemberStore, OperationStore):
    """Sessions, queues and holds, switches, membership and operator operations over one
    etcd client."""
