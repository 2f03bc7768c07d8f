"""Removing idle groups, so throwaway group ids do not grow the replicas or etcd forever.

A group is **idle** when, in this replica's mirror, it has

- no holder, no queue entry, no switch in progress, no driver claiming it, no fault record;
- no operator operation record (each expires with its own lease, after its retention, so
  GetOperation answers for that long);
- no pinned members (an operator's pin is configuration, kept until unpinned);
- no residency: no node is recorded as having any job's state on its devices;
- no registered worker: no agent record lists a worker of the group;

and none of its keys has changed for ``idle_group_ttl`` seconds. What goes with it is its
meta, its statistics and its usage ledger (history of a group nobody uses).

Residency is never dropped by the clean-up: a group whose state is recorded on some node is
not idle, however long nobody used it, because forgetting it would let a later grant count
on free devices that still hold a job's state. Residency goes only the ways it always went
(an agent reports the state gone, a switch moves it, a fenced node's becomes unknown, and that
node's next hello reconciles it), and the group becomes idle after that.

Each pass scans a bounded slice of the groups (round robin, yielding to the event loop
between chunks) and removes at most ``cleanup_batch`` of them; each removal is one
transaction that compares the whole key range against the revision the group was judged
idle at (:mod:`.store.idle`), so replicas racing on the same group are harmless. How long a
group has been idle is this replica's own observation (etcd keeps no times): after a restart
the wait starts again, which only delays a removal.
"""

from __future__ import annotations

import asyncio
import logging
import time

from timeslice_orchestrator.limits import Limits
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.store.etcd import StoreUnavailable
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.idle import IdleStore
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import CorruptRecord

log = logging.getLogger(__name__)

# Groups examined per pass, as a multiple of the removal batch.
_SCAN_FACTOR = 8
# Groups examined between two yields to the event loop (keeps other calls' latency flat).
_CHUNK = 64
# Longest pause between passes; a short TTL makes them more frequent.
_MAX_INTERVAL = 30.0
_MIN_INTERVAL = 0.05


def is_idle(view: GroupView, groups_with_workers: set[str]) -> bool:
    """Whether nothing holds, waits for, moves, pins or keeps state of the group."""
    residency = view.resident.record.nodes if view.resident else {}
    return (
        view.exists
        and view.holder is None
        and not view.queue
        and view.switch is None
        and view.driver is None
        and not view.faults
        and not view.operations
        and not view.static_members
        and not any(residency.values())
        and view.group not in groups_with_workers
    )


class IdleGroupCleaner:
    def __init__(self, store: IdleStore, mirror: Mirror, limits: Limits, metrics: Metrics) -> None:
        self._store = store
        self._mirror = mirror
        self._ttl = limits.idle_group_ttl
        self._batch = limits.cleanup_batch
        self._metrics = metrics
        # Per group: the newest revision of its keys when it was first seen idle, and when.
        # Bounded by the number of groups (a quota); entries of groups gone are pruned.
        self._idle_since: dict[str, tuple[int, float]] = {}
        self._cursor = ""
        self.removed = 0

    @property
    def interval(self) -> float:
        return min(_MAX_INTERVAL, max(_MIN_INTERVAL, self._ttl / 4))

    async def run(self) -> None:
        """Sweep forever (a supervised task); etcd being away only skips passes."""
        if self._ttl <= 0:
            return
        while True:
            try:
                await self.sweep()
            except StoreUnavailable as exc:
                log.info("idle-group clean-up skipped a pass: %s", exc)
            await asyncio.sleep(self.interval)

    async def sweep(self, now: float | None = None) -> int:
        """One bounded pass; returns how many groups it removed."""
        now = time.monotonic() if now is None else now
        names = self._mirror.group_names()
        self._metrics.groups.set(len(names))
        if not names:
            self._idle_since.clear()
            return 0
        # Round robin from where the last pass stopped.
        start = next((i for i, n in enumerate(names) if n > self._cursor), 0)
        window = (names[start:] + names[:start])[: self._batch * _SCAN_FACTOR]
        with_workers = {w.group for a in self._mirror.agents().values() for w in a.workers}
        due: list[tuple[str, int]] = []
        for i, group in enumerate(window):
            if i and i % _CHUNK == 0:
                await asyncio.sleep(0)
            self._cursor = group
            try:
                view = self._mirror.group(group)
            except CorruptRecord:
                log.exception("idle-group clean-up: skipping %s (a corrupt record)", group)
                continue
            if not is_idle(view, with_workers):
                self._idle_since.pop(group, None)
                continue
            revision = self._mirror.group_revision(group)
            seen = self._idle_since.get(group)
            if seen is None or seen[0] != revision:
                self._idle_since[group] = (revision, now)
            elif now - seen[1] >= self._ttl and len(due) < self._batch:
                due.append((group, revision))
        removed = 0
        for group, revision in due:
            if await self._store.remove_idle_group(group, revision):
                removed += 1
            self._idle_since.pop(group, None)
        if len(self._idle_since) > len(names):
            live = set(names)
            self._idle_since = {g: s for g, s in self._idle_since.items() if g in live}
        if removed:
            self.removed += removed
            self._metrics.idle_groups_removed.inc(removed)
            log.info("removed %d idle group(s) (idle for %g s)", removed, self._ttl)
        return removed
