"""A read-only mirror of the deployment's keys, kept by one list-then-watch loop per replica.

:class:`Mirror` is the follower: it lists every key at one revision, then watches from the next
one, applying each batch to its index (:class:`~timeslice_orchestrator.store.mirror.MirrorIndex`,
the typed accessors), and wakes those who wait for a change of a topic or for a revision to
show. It re-lists on compaction or when etcd lost writes, and resumes the watch on errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Callable

from timeslice.backoff import Backoff
from timeslice_orchestrator.store.etcd import (
    Compacted,
    EtcdClient,
    EtcdRewound,
    EventType,
    KeyValue,
    MustRelist,
    StoreUnavailable,
    WatchBatch,
)
from timeslice_orchestrator.store.keys import KeyRef, Keyspace, Kind
from timeslice_orchestrator.store.mirror import MirrorIndex
from timeslice_orchestrator.store.owners import OWNED

log = logging.getLogger(__name__)

__all__ = ["Mirror"]

# How far behind its own writes a replica's mirror may be before callers answer UNAVAILABLE.
MIRROR_LAG_TIMEOUT = 10.0
# A watch that brings back none of this replica's own writes for this long is taken for stuck
# and started again, on the next etcd member, from the mirror's revision + 1. (Seen once under
# heavy load: after a member's watch streams failed INTERNAL, the watch resumed on another
# member delivered nothing for over 10 s while that member answered reads.)
WATCH_STUCK_AFTER = 3.0
# A watch that has brought nothing for this long gets a beacon: the mirror writes its beacon key
# and waits for it through the watch, so the rule above also covers a replica with nothing of
# its own to write (one whose driver waits for a release made through another replica). A
# deployment with traffic never writes one; a quiet one writes about one per interval, since
# each replica's beacon is news to the others' watches.
WATCH_QUIET_AFTER = 5.0
_STUCK_CHECK_EVERY = 0.5

# Keys indexed between two looks at the event loop while listing.
_YIELD_EVERY = 4096


class Mirror(MirrorIndex):
    """List-watch mirror of everything under the keyspace root: the index and its typed
    accessors (:class:`~timeslice_orchestrator.store.mirror.MirrorIndex`), kept by this
    follower, which also wakes those waiting for a topic to change or a revision to show."""

    def __init__(self, etcd: EtcdClient, keys: Keyspace, *, name: str = "mirror") -> None:
        super().__init__(keys)
        self._etcd = etcd
        self._name = name  # written in the beacon key, to tell whose it was
        self.synced = asyncio.Event()
        # Callers of wait_for_change, by topic (none kept for a topic nobody waits for).
        self._change_waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._listeners: list[Callable[[set[str]], None]] = []
        self.listener_errors = 0
        """Listener calls that raised (each logged); the mirror went on."""
        self._versions: dict[str, int] = {}
        self._revision_waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        # Since when (time.monotonic()) the mirror has been behind a write it was told of and
        # has not moved towards it; None when it is not behind.
        self._behind_since: float | None = None
        # When (time.monotonic()) the watch last brought something, or a beacon was written.
        self._heard_at = time.monotonic()
        self._seq = 0
        self.reconnects = 0
        self.rewinds = 0
        """Times etcd was found behind the mirror (it lost acknowledged writes): re-listed."""
        # Set by a beacon write that came back at or below the mirror's revision.
        self._rewound: EtcdRewound | None = None
        # The newest write the watch brought: a resumed watch checks etcd still has it.
        self._last_put: KeyValue | None = None

    # -- waiting ------------------------------------------------------------------------

    def version(self, topic: str) -> int:
        """Moves with every change seen on ``topic`` (0: none kept); read it before looking,
        then :meth:`wait_for_change` from it, so that no change is missed in between.

        Versions come from one counter for all topics, so a topic forgotten (every key of it
        gone) and seen again never repeats a version a waiter may hold."""
        return self._versions.get(topic, 0)

    @property
    def tracked_topics(self) -> int:
        """Topics with a version or a waiter kept (diagnostics: it follows the keys, not
        every group name ever seen)."""
        return len(self._versions.keys() | self._change_waiters.keys())

    async def wait_for_change(self, topic: str, seen: int) -> None:
        """Until :meth:`version` of ``topic`` is no longer ``seen``."""
        loop = asyncio.get_running_loop()
        while self._versions.get(topic, 0) == seen:
            changed = loop.create_future()
            waiters = self._change_waiters.setdefault(topic, set())
            waiters.add(changed)
            try:
                await changed
            finally:
                waiters.discard(changed)
                if not waiters and self._change_waiters.get(topic) is waiters:
                    del self._change_waiters[topic]

    def add_listener(self, listener: Callable[[set[str]], None]) -> None:
        """Call ``listener(topics)`` after every applied batch of changes."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Callable[[set[str]], None]) -> None:
        """Stop calling ``listener`` (a driver or router of a replica term that ended)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    async def wait_for_revision(self, revision: int, timeout: float) -> None:
        """Wait until the mirror reflects ``revision`` (one of our own writes)."""
        if self.revision >= revision:
            return
        # A heap of futures, resolved in revision order as batches land: no waiter is woken
        # by changes that do not concern it.
        waiter = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._revision_waiters, (revision, self._seq, waiter))
        if self._behind_since is None:
            self._behind_since = time.monotonic()
        reached = False
        try:
            async with asyncio.timeout(timeout):
                await waiter
            reached = True
        except TimeoutError as exc:
            # Typed, so callers answer UNAVAILABLE (clients retry elsewhere), never a bare 500.
            raise StoreUnavailable(
                f"this replica's view of etcd is more than {timeout:g} s behind "
                f"(at revision {self.revision}, waiting for {revision})"
            ) from exc
        finally:
            if not reached:
                # Given up on (timed out, or its caller cancelled): it no longer counts as
                # the mirror being behind.
                waiter.cancel()
                self._revision_waiters = [w for w in self._revision_waiters if not w[2].done()]
                heapq.heapify(self._revision_waiters)
                if not self._revision_waiters:
                    self._behind_since = None

    async def catch_up(self, timeout: float) -> None:
        """Write the beacon key and wait until the watch brings it back: the mirror then holds
        everything etcd held before it. (etcd's revision alone can move by writes under other
        prefixes, which no event here shows.) Raises StoreUnavailable if etcd does not take
        the write, or the watch does not bring it back within ``timeout``."""
        # Read before the write: the watch may bring the write back before its answer.
        seen = self.revision
        written = await self._etcd.put(self._keys.beacon(), self._name.encode())
        if written <= seen:
            # A new write not past what the mirror had seen before it: etcd lost writes (its
            # revisions are being used again), which no watch reports. _watch re-lists.
            self._rewound = EtcdRewound(
                f"etcd wrote the beacon at revision {written}, not past revision {seen} that "
                f"this replica had seen: it lost writes it had acknowledged"
            )
            raise StoreUnavailable(str(self._rewound))
        await self.wait_for_revision(written, timeout)

    def _release_revision_waiters(self) -> None:
        released = False
        while self._revision_waiters and self._revision_waiters[0][0] <= self.revision:
            _, _, waiter = heapq.heappop(self._revision_waiters)
            released = True
            if not waiter.done():
                waiter.set_result(None)
        if not self._revision_waiters:
            self._behind_since = None
        elif released:
            self._behind_since = time.monotonic()  # moving: the watch is not stuck

    # -- maintaining --------------------------------------------------------------------

    async def run(self) -> None:
        """List, then watch from the next revision; re-list on compaction, resume on errors.

        A watch resumed after an error first checks that etcd is not behind the mirror: a
        watch from a revision etcd has not reached (it lost writes) waits silently for new
        ones and would skip those that reuse the lost revisions."""
        backoff = Backoff(jitter=False)
        resuming = False
        while True:
            try:
                if not self.synced.is_set():
                    await self._relist()
                elif resuming:
                    await self._check_not_rewound()
                resuming = False
                await self._watch(backoff)
            except EtcdRewound as exc:
                self.rewinds += 1
                log.error("%s; re-listing", exc)
                self._fail_revision_waiters(exc)
                self.synced.clear()
            except MustRelist as exc:
                # The watch's start, or the revision a paged list was being read at, is gone,
                # or a watch response did not fit: list afresh and watch on from there.
                log.warning("%s; re-listing", exc)
                self.synced.clear()
            except StoreUnavailable as exc:
                self.reconnects += 1
                resuming = True
                log.warning("etcd watch interrupted (%s); resuming from %d", exc, self.revision + 1)
                await asyncio.sleep(backoff.next_delay())

    async def _check_not_rewound(self) -> None:
        """Raise EtcdRewound if etcd lost writes this mirror has seen: its revision is behind
        the mirror's, or (new writes may have taken it past since) the newest write the
        watch brought is not what etcd has at that revision."""
        current = await self._etcd.revision(self._keys.root)
        if current < self.revision:
            raise EtcdRewound(
                f"etcd is at revision {current}, behind revision {self.revision} that this "
                f"replica has seen: it lost writes it had acknowledged"
            )
        last = self._last_put
        if last is None:
            return
        try:
            there = await self._etcd.get(last.key, revision=last.mod_revision)
        except Compacted:
            return  # that history is gone: the resumed watch is told so, and re-lists
        if there != last:
            raise EtcdRewound(
                f"etcd's revision {last.mod_revision} is not the write of {last.key!r} this "
                f"replica saw there: it lost writes it had acknowledged"
            )

    def _fail_revision_waiters(self, rewound: EtcdRewound) -> None:
        """Callers waiting for their writes to show: those writes may be among the lost, and
        new writes will reuse their revisions. They answer UNAVAILABLE; clients retry."""
        waiters, self._revision_waiters = self._revision_waiters, []
        self._behind_since = None
        for _, _, waiter in waiters:
            if not waiter.done():
                waiter.set_exception(StoreUnavailable(str(rewound)))

    async def _watch(self, backoff: Backoff) -> None:
        """Apply the watch's batches until it fails, or until it looks stuck (it brought back
        none of this replica's writes for :data:`WATCH_STUCK_AFTER`): then its member is
        passed over and StoreUnavailable makes :meth:`run` resume it. A quiet watch gets a
        beacon (:meth:`_beacon_when_quiet`), so it always has a write of ours to bring back."""
        follow = asyncio.ensure_future(self._follow(backoff))
        beacon = asyncio.ensure_future(self._beacon_when_quiet())
        try:
            while not follow.done():
                await asyncio.wait(
                    {follow, beacon},
                    timeout=_STUCK_CHECK_EVERY,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if beacon.done():
                    beacon.result()  # it only ends by a bug: let the supervisor see it
                if self._rewound is not None:
                    raise self._rewound
                behind = self._behind_since
                if follow.done() or behind is None:
                    continue
                if time.monotonic() - behind < WATCH_STUCK_AFTER:
                    continue
                self._behind_since = time.monotonic()  # the next watch gets its own time
                reason = (
                    f"the watch brought back none of this replica's writes for "
                    f"{WATCH_STUCK_AFTER:g} s (at revision {self.revision})"
                )
                self._etcd.pass_over_watch_member(reason)
                follow.cancel()
                await asyncio.wait({follow})
                raise StoreUnavailable(f"{reason}: starting it again")
            follow.result()
        finally:
            follow.cancel()
            beacon.cancel()
            await asyncio.wait({follow, beacon})

    async def _beacon_when_quiet(self) -> None:
        """Each time the watch has brought nothing for :data:`WATCH_QUIET_AFTER`, write the
        beacon and wait for it: a stuck watch then trips the rule of :meth:`_watch`."""
        while True:
            quiet_for = time.monotonic() - self._heard_at
            if quiet_for < WATCH_QUIET_AFTER:
                await asyncio.sleep(WATCH_QUIET_AFTER - quiet_for)
                continue
            self._heard_at = time.monotonic()  # one beacon per quiet interval
            try:
                await self.catch_up(MIRROR_LAG_TIMEOUT)
            except StoreUnavailable as exc:
                # etcd is down (the watch fails too and resumes on its own), or the watch is
                # stuck and _watch has already passed its member over.
                log.debug("watch beacon not seen: %s", exc)

    async def _follow(self, backoff: Backoff) -> None:
        async for batch in self._etcd.watch_prefix(self._keys.root, self.revision + 1):
            backoff.reset()
            await self._apply(batch)

    async def _relist(self) -> None:
        """Read every key, page by page at one revision, then replace the mirror at once.

        Readers keep the previous snapshot (or none, before the first sync) until the last
        page is in: a half-read listing is never visible. Pages are indexed as they arrive, so
        at most two pages of etcd's messages (this one and the next, read ahead) are held.
        """
        topics: dict[str, dict[KeyRef, KeyValue]] = {}
        groups: set[str] = set()
        revision = 0
        parse = self._keys.parse
        # Keys come in key order, so a group's keys come together: look its topic up once.
        group, keys = "", {}
        holders: list[tuple[str, KeyValue]] = []
        owned: list[tuple[KeyRef, KeyValue]] = []  # sessions, entries and holds: the quotas
        operations: dict[str, str] = {}
        async with contextlib.aclosing(self._etcd.pages(self._keys.root)) as pages:
            async for at, page in pages:
                revision = at
                for n, kv in enumerate(page, 1):
                    if n % _YIELD_EVERY == 0:
                        # A page is tens of thousands of keys: let the rest of the replica
                        # (its lease keepalive first) run between slices of it.
                        await asyncio.sleep(0)
                    ref = parse(kv.key)
                    if ref is None:
                        continue
                    if ref.kind is Kind.HOLDER:
                        holders.append((ref.group, kv))
                    if ref.kind in OWNED:
                        owned.append((ref, kv))
                    elif ref.kind is Kind.OPERATION:
                        operations[ref.name] = ref.group
                    if not ref.group or ref.group != group:
                        keys = topics.setdefault(ref.topic, {})
                        group = ref.group
                        if group:
                            groups.add(group)
                    keys[ref] = kv
        old = set(self._topics)
        self._replace(topics, groups, holders, owned, operations)
        self.revision = revision
        self._last_put = None
        self._rewound = None  # whatever a beacon found is covered by this listing
        self._heard_at = time.monotonic()
        self.synced.set()
        await self._notify(old | set(topics))

    async def _apply(self, batch: WatchBatch) -> None:
        if batch.events:  # an empty batch (etcd's progress notification) is no news
            self._heard_at = time.monotonic()
        topics: set[str] = set()
        for ev in batch.events:
            ref = self._keys.parse(ev.kv.key)
            if ref is None:
                continue  # not a key of the layout: nothing reads it
            if ev.type is EventType.PUT:
                self._store(ref, ev.kv)
                self._last_put = ev.kv
            else:
                self._drop(ref)
            topics.add(ref.topic)
        # A batch's header revision can run ahead of its events while a watcher catches up,
        # so only an empty batch (a progress notification) may move the revision past them.
        newest = max((ev.kv.mod_revision for ev in batch.events), default=batch.revision)
        if newest > self.revision:
            self.revision = newest
        await self._notify(topics)

    async def _notify(self, topics: set[str]) -> None:
        self._release_revision_waiters()
        for topic in (*topics, "*"):
            self._seq += 1
            if topic == "*" or topic in self._topics:
                self._versions[topic] = self._seq
            else:
                # Every key of it is gone: a version kept for it would be kept for good.
                self._versions.pop(topic, None)
            for changed in self._change_waiters.pop(topic, ()):
                if not changed.done():
                    changed.set_result(None)
        for listener in self._listeners:
            try:
                listener(topics)
            except Exception:
                # An observer's bug (a record it cannot decode) must not stop the mirror that
                # every call of this replica reads, nor keep the change from the others.
                self.listener_errors += 1
                log.exception("mirror listener %r failed on %s", listener, sorted(topics))
