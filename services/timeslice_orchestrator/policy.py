"""Which waiter a group serves next.

- ``fifo`` (default): enqueue order (queue entry create revision).
- ``priority``: the highest ``priority`` first; FIFO among equals.
- ``fair``: weighted fair share of accelerator time: the waiter whose held time so far,
  divided by its weight (``max(1, priority)``), is smallest; FIFO among equals. Held time comes
  from the group's usage ledger, which every yield updates.

Mutual exclusion, fencing and the two-phase switch do not depend on the policy: it only picks.
"""

from __future__ import annotations

import enum

from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import QueuedJob


class Policy(enum.Enum):
    FIFO = "fifo"
    PRIORITY = "priority"
    FAIR = "fair"


def order(policy: Policy, view: GroupView) -> list[QueuedJob]:
    """The group's waiters in the order ``policy`` serves them."""
    queue = view.queue  # already FIFO
    if policy is Policy.PRIORITY:
        return sorted(queue, key=lambda q: (-q.entry.record.priority, q.revision))
    if policy is Policy.FAIR:
        ledger = view.usage.record.jobs if view.usage else {}

        def share(q: QueuedJob) -> tuple[float, int]:
            held = ledger[q.job].held_seconds if q.job in ledger else 0.0
            return held / max(1, q.entry.record.priority), q.revision

        return sorted(queue, key=share)
    return list(queue)
