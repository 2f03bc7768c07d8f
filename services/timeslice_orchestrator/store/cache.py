"""A read-only mirror of the deployment's keys, kept by one list-then-watch loop per replica.

Acquire waiters and the switch driver read group state from here and wait on per-topic
conditions instead of each opening its own etcd watch. It is a cache, never an authority:
every decision that changes state is an etcd transaction with compares.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from timeslice.backoff import Backoff
from timeslice_orchestrator.store.etcd import (
    EtcdClient,
    EventType,
    KeyValue,
    StoreUnavailable,
    WatchCompacted,
)
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import (
    AgentRecord,
    CorruptRecord,
    FaultRecord,
    GroupStats,
    HolderRecord,
    MembersRecord,
    QueueRecord,
    ResidentRecord,
    SessionRecord,
    Stored,
    SwitchRecord,
    UsageRecord,
)

log = logging.getLogger(__name__)

AGENTS_TOPIC = "agents"
SESSIONS_TOPIC = "sessions"


def topic_of(rel: str) -> str:
    """The notification topic of a relative key: "group:<g>", "agents" or "sessions"."""
    parts = rel.split("/", 2)
    if parts[0] == "groups" and len(parts) > 1:
        return f"group:{parts[1]}"
    return parts[0]


@dataclass(slots=True)
class QueuedJob:
    job: str
    entry: Stored[QueueRecord]

    @property
    def revision(self) -> int:
        return self.entry.create_revision


@dataclass(slots=True)
class GroupView:
    """A consistent snapshot of one group's keys at ``revision``."""

    group: str
    revision: int
    exists: bool
    holder: Stored[HolderRecord] | None
    queue: list[QueuedJob]  # FIFO: ordered by create revision
    resident: Stored[ResidentRecord] | None
    switch: Stored[SwitchRecord] | None
    driver: str | None
    driver_lease: int
    faults: dict[str, Stored[FaultRecord]] = field(default_factory=dict)
    stats: GroupStats = field(default_factory=GroupStats)
    static_members: list[str] = field(default_factory=list)
    usage: Stored[UsageRecord] | None = None

    def queued(self, job: str) -> QueuedJob | None:
        return next((q for q in self.queue if q.job == job), None)

    def position(self, job: str) -> int | None:
        return next((i for i, q in enumerate(self.queue) if q.job == job), None)

    def residency(self) -> ResidentRecord:
        """A copy of the residency record to edit (empty when there is none)."""
        nodes = self.resident.record.nodes if self.resident else {}
        return ResidentRecord({node: list(jobs) for node, jobs in nodes.items()})

    @property
    def resident_revision(self) -> int:
        return self.resident.mod_revision if self.resident else 0


class Mirror:
    """List-watch mirror of everything under the keyspace root."""

    def __init__(self, etcd: EtcdClient, keys: Keyspace) -> None:
        self._etcd = etcd
        self._keys = keys
        self._kvs: dict[str, KeyValue] = {}
        # The same keys indexed by topic, so reading one group costs its own few keys.
        self._by_topic: dict[str, dict[str, KeyValue]] = {}
        self.revision = 0
        self.synced = asyncio.Event()
        self._conditions: dict[str, asyncio.Condition] = {}
        self._listeners: list[Callable[[set[str]], None]] = []
        self._versions: dict[str, int] = {}
        self._revision_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = 0
        self.reconnects = 0

    # -- reading ------------------------------------------------------------------------

    def get(self, rel: str) -> KeyValue | None:
        return self._kvs.get(rel)

    def under(self, rel_prefix: str) -> list[tuple[str, KeyValue]]:
        """Keys under ``rel_prefix``, which must lie within one topic (a group, agents, ...)."""
        keys = self._by_topic.get(topic_of(rel_prefix), {})
        return sorted((k, v) for k, v in keys.items() if k.startswith(rel_prefix))

    def group_names(self) -> list[str]:
        return sorted(t[6:] for t in self._by_topic if t.startswith("group:"))

    def _store(self, rel: str, kv: KeyValue) -> None:
        self._kvs[rel] = kv
        self._by_topic.setdefault(topic_of(rel), {})[rel] = kv

    def _drop(self, rel: str) -> None:
        self._kvs.pop(rel, None)
        topic = topic_of(rel)
        keys = self._by_topic.get(topic)
        if keys is not None:
            keys.pop(rel, None)
            if not keys:
                del self._by_topic[topic]

    def session(self, session_id: str) -> Stored[SessionRecord] | None:
        kv = self._kvs.get(f"sessions/{session_id}")
        return Stored.of(kv, SessionRecord.decode(kv.value)) if kv else None

    def agents(self) -> dict[str, AgentRecord]:
        out: dict[str, AgentRecord] = {}
        for rel, kv in self.under("agents/"):
            try:
                out[rel.split("/", 1)[1]] = AgentRecord.decode(kv.value)
            except CorruptRecord:
                log.exception("ignoring corrupt agent record %s", rel)
        return out

    def group(self, group: str) -> GroupView:
        base = f"groups/{group}/"
        holder = resident = switch = None
        driver: str | None = None
        driver_lease = 0
        queue: list[QueuedJob] = []
        faults: dict[str, Stored[FaultRecord]] = {}
        stats = GroupStats()
        members: list[str] = []
        usage: Stored[UsageRecord] | None = None
        exists = False
        for rel, kv in self.under(base):
            exists = True
            name = rel[len(base) :]
            if name == "holder":
                holder = Stored.of(kv, HolderRecord.decode(kv.value))
            elif name == "resident":
                resident = Stored.of(kv, ResidentRecord.decode(kv.value))
            elif name == "switch":
                switch = Stored.of(kv, SwitchRecord.decode(kv.value))
            elif name == "driver":
                driver, driver_lease = kv.value.decode(), kv.lease
            elif name == "stats":
                stats = GroupStats.decode(kv.value)
            elif name == "members":
                members = MembersRecord.decode(kv.value).nodes
            elif name == "usage":
                usage = Stored.of(kv, UsageRecord.decode(kv.value))
            elif name.startswith("queue/"):
                queue.append(QueuedJob(name[6:], Stored.of(kv, QueueRecord.decode(kv.value))))
            elif name.startswith("faulted/"):
                faults[name[8:]] = Stored.of(kv, FaultRecord.decode(kv.value))
        queue.sort(key=lambda q: q.revision)
        return GroupView(
            group,
            self.revision,
            exists,
            holder,
            queue,
            resident,
            switch,
            driver,
            driver_lease,
            faults,
            stats,
            members,
            usage,
        )

    # -- waiting ------------------------------------------------------------------------

    def condition(self, topic: str) -> asyncio.Condition:
        cond = self._conditions.get(topic)
        if cond is None:
            cond = self._conditions[topic] = asyncio.Condition()
        return cond

    def version(self, topic: str) -> int:
        """Counts the changes seen on ``topic``; wait for it to move to avoid lost wake-ups."""
        return self._versions.get(topic, 0)

    async def wait_for_change(self, topic: str, seen: int) -> None:
        cond = self.condition(topic)
        async with cond:
            await cond.wait_for(lambda: self._versions.get(topic, 0) != seen)

    def add_listener(self, listener: Callable[[set[str]], None]) -> None:
        """Call ``listener(topics)`` after every applied batch of changes."""
        self._listeners.append(listener)

    async def wait_for_revision(self, revision: int, timeout: float) -> None:
        """Wait until the mirror reflects ``revision`` (one of our own writes)."""
        if self.revision >= revision:
            return
        # A heap of futures, resolved in revision order as batches land: no waiter is woken
        # by changes that do not concern it.
        waiter = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._revision_waiters, (revision, self._seq, waiter))
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError as exc:
            # Typed, so callers answer UNAVAILABLE (clients retry elsewhere), never a bare 500.
            raise StoreUnavailable(
                f"this replica's view of etcd is more than {timeout:g} s behind "
                f"(at revision {self.revision}, waiting for {revision})"
            ) from exc

    def _release_revision_waiters(self) -> None:
        while self._revision_waiters and self._revision_waiters[0][0] <= self.revision:
            _, _, waiter = heapq.heappop(self._revision_waiters)
            if not waiter.done():
                waiter.set_result(None)

    # -- maintaining --------------------------------------------------------------------

    async def run(self) -> None:
        """List, then watch from the next revision; re-list on compaction, resume on errors."""
        backoff = Backoff(jitter=False)
        while True:
            try:
                if not self.synced.is_set():
                    await self._relist()
                async for batch in self._etcd.watch_prefix(self._keys.root, self.revision + 1):
                    backoff.reset()
                    await self._apply(batch.revision, batch.events)
            except WatchCompacted as exc:
                log.warning("watch compacted (%s); re-listing", exc)
                self.synced.clear()
            except StoreUnavailable as exc:
                self.reconnects += 1
                log.warning("etcd watch interrupted (%s); resuming from %d", exc, self.revision + 1)
                await asyncio.sleep(backoff.next_delay())

    async def _relist(self) -> None:
        revision, kvs = await self._etcd.get_prefix(self._keys.root)
        old = set(self._kvs)
        self._kvs = {}
        self._by_topic = {}
        for kv in kvs:
            self._store(self._keys.relative(kv.key), kv)
        self.revision = revision
        self.synced.set()
        await self._notify({topic_of(k) for k in old | set(self._kvs)})

    async def _apply(self, revision: int, events: tuple[object, ...]) -> None:
        topics: set[str] = set()
        for ev in events:
            kv = ev.kv  # type: ignore[attr-defined]
            rel = self._keys.relative(kv.key)
            if ev.type is EventType.PUT:  # type: ignore[attr-defined]
                self._store(rel, kv)
            else:
                self._drop(rel)
            topics.add(topic_of(rel))
        # A batch's header revision can run ahead of its events while a watcher catches up,
        # so only an empty batch (a progress notification) may move the revision past them.
        newest = max((ev.kv.mod_revision for ev in events), default=revision)  # type: ignore[attr-defined]
        if newest > self.revision:
            self.revision = newest
        await self._notify(topics)

    async def _notify(self, topics: set[str]) -> None:
        self._release_revision_waiters()
        for topic in (*topics, "*"):
            self._versions[topic] = self._versions.get(topic, 0) + 1
            cond = self._conditions.get(topic)
            if cond is not None:
                async with cond:
                    cond.notify_all()
        for listener in self._listeners:
            listener(topics)
