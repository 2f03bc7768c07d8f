"""Acquire and yield: what the client API does, in terms of the store and the mirror.

An Acquire of a group that is free, with nobody waiting and nothing to move, is granted in
its own transaction. Otherwise it puts the job in the group's queue, then waits on the mirror
(one etcd watch per replica, never polling) until the driver grants it, streaming its
progress. Leaving early (cancel, deadline, disconnect) withdraws the queue entry, or gives
back a grant that raced the exit, so no waiter is lost and no grant leaks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from timeslice import AcquireStage
from timeslice.errors import (
    Cancelled,
    FailedPrecondition,
    GroupFaulted,
    InvalidArgument,
    NotFound,
    NotHolder,
    PermissionDenied,
    SessionExpired,
    Unauthenticated,
)
from timeslice.ids import validate_group_id, validate_job_id, validate_node
from timeslice.tasks import run_to_completion
from timeslice.tracing import current_carrier
from timeslice_orchestrator.authz import new_session_secret, secret_hash, secret_matches
from timeslice_orchestrator.grants import (
    HandOvers,
    KnownGroups,
    changed,
    holder_for,
    in_place,
    resident_after_grant,
)
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.policy import Policy, order
from timeslice_orchestrator.store.etcd import StoreUnavailable
from timeslice_orchestrator.store.follower import MIRROR_LAG_TIMEOUT, Mirror
from timeslice_orchestrator.store.groups import (
    Enqueued,
    EnqueueRequest,
    FreeGroup,
    Grant,
    GroupStore,
    Hold,
    lease_of,
)
from timeslice_orchestrator.store.keys import group_topic
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import Hint, SessionRecord, Stored, hold_epoch

log = logging.getLogger(__name__)

# Groups whose last yield here the mirror may not show yet, kept at most (then pruned).
_RELEASED_KEPT = 1024
MAX_TTL = 3600
# How long a yield that handed the group over waits for the waiter's stream to send the grant
# before it answers its own caller: the waiter is the one the hand-over is for.
_WAITER_FIRST_SECONDS = 0.1


@dataclass(frozen=True, slots=True)
class Progress:
    stage: AcquireStage
    position: int = 0
    epoch: int = 0
    waited_seconds: float = 0.0
    restored: bool = False
    previous_job: str = ""
    switch_seconds: float = 0.0
    ticket: int = 0
    # The Acquire attempt (one per call to a replica) the progress is for: a grant it could
    # not deliver is given back only while the hold is still that attempt's.
    attempt: str = ""
    # Set on GRANTED when the group is not known (unknown_group_text): "" when all is well.
    warning: str = ""


@dataclass(frozen=True, slots=True)
class _LocalWaiter:
    """An Acquire call waiting on this replica: a hand-over made here answers it directly."""

    entry_revision: int
    attempt: str
    granted: asyncio.Future[Progress]
    # Set when the Acquire call is over: on the v1 API once its grant was sent (the stream
    # resumes the call after sending it), on the v1alpha1 API as the grant is taken (its
    # answer follows at once), or when the call ended without one.
    ended: asyncio.Event = field(default_factory=asyncio.Event)


def _no_warning(group: str) -> str:
    return ""


class LockService:
    def __init__(
        self,
        store: GroupStore,
        mirror: Mirror,
        metrics: Metrics,
        default_ttl: int,
        policy: Policy = Policy.FIFO,
        max_hold: float = 0.0,
    ) -> None:
        self._store = store
        self._mirror = mirror
        self._known_groups = KnownGroups(mirror)
        self._metrics = metrics
        self._default_ttl = default_ttl
        self.policy = policy
        self._max_hold = max_hold
        # Set while the replica shuts down: its waiters are about to re-attach elsewhere,
        # so their streams ending is no reason to give up their places or grants.
        self.draining = False
        # The revision of the last yield of each group through this replica: an Acquire of
        # the group here first lets the mirror catch up with it, so that a client taking
        # its group back at once finds it free (and takes it in one transaction) instead of
        # queueing behind its own hold.
        self._released: dict[str, int] = {}
        # Acquire calls waiting here, by (group, job): a yield served here that hands the
        # group to one of them answers it at once, without waiting for the watch to bring
        # the grant back into the mirror.
        self._waiting: dict[tuple[str, str], _LocalWaiter] = {}
        # Groups being handed over here: this replica's driver leaves them alone meanwhile.
        self.hand_overs = HandOvers()

    async def open_session(self, job: str, ttl: int, host: str, pid: int) -> tuple[str, str, int]:
        """Open a session; returns its id, its secret (the only time it is told) and TTL."""
        validate_job_id(job)
        if ttl < 0 or ttl > MAX_TTL:
            raise InvalidArgument(f"ttl_seconds must be between 1 and {MAX_TTL} (0 = default)")
        ttl = ttl or self._default_ttl
        secret = new_session_secret()
        sid = await self._store.open_session(
            job, ttl, host[:253], pid, secret_hash=secret_hash(secret)
        )
        return sid, secret, ttl

    async def authenticate(self, session_id: str, secret: str) -> Stored[SessionRecord]:
        """The session, if ``secret`` is its secret: the check before any call acts on it.

        Raises NotFound (not a session id), SessionExpired (gone), or Unauthenticated (the
        secret is missing or wrong: knowing the id, or an epoch, is not enough).
        """
        lease_of(session_id)
        # The mirror's copy saves an etcd read; a session record never changes once written.
        session = self._mirror.session(session_id) or await self._store.session(session_id)
        if not secret_matches(secret, session.record.secret_hash):
            raise Unauthenticated(f"session {session_id}: session secret missing or wrong")
        return session

    async def keepalive(self, session_id: str, secret: str) -> tuple[int, list[str]]:
        """Refresh the session; also return the groups it is asked to yield."""
        await self.authenticate(session_id, secret)
        ttl = await self._store.keepalive(session_id)
        return ttl, self.yield_requested(session_id)

    def yield_requested(self, session_id: str) -> list[str]:
        """Groups this session has held past the maximum hold while others wait."""
        if self._max_hold <= 0:
            return []
        now = time.time()
        asked = []
        for group in self._mirror.held_by(session_id):
            view = self._mirror.group(group)
            holder = view.holder
            if (
                holder is not None
                and holder.record.session == session_id
                and view.queue
                and now - holder.record.granted_at > self._max_hold
            ):
                asked.append(group)
        return asked

    async def close_session(self, session_id: str, secret: str) -> None:
        await self.authenticate(session_id, secret)
        await self._store.close_session(session_id)

    async def acquire(
        self,
        session_id: str,
        job: str,
        group: str,
        priority: int,
        request_id: str = "",
        *,
        secret: str,
        strict: bool = False,
        warn: bool = False,
    ) -> AsyncGenerator[Progress, None]:
        """Queue ``job`` for ``group`` and yield its progress; the last item is GRANTED.

        A group that is not known (:class:`~timeslice_orchestrator.grants.KnownGroups`): with
        ``strict`` refused with NotFound before anything is written; else, with ``warn``,
        granted with a warning. The v1alpha1 (llm-d) API asks for neither: its groups are
        created on first acquire, as the reference's are.
        """
        validate_job_id(job)
        validate_group_id(group)
        # The enqueue transaction compares the session still exists, so a stale mirror copy
        # costs a retry, never a wrong answer.
        session = await self.authenticate(session_id, secret)
        if session.record.job != job:
            raise PermissionDenied(f"session {session_id} belongs to job {session.record.job}")
        started = time.monotonic()
        if len(request_id) > 64:
            raise InvalidArgument("request_id must be at most 64 characters")
        if strict:
            await self._known_groups.require(group)
        warning = self._known_groups.warning if warn else _no_warning
        attempt = uuid.uuid4().hex[:16]
        request = EnqueueRequest(
            session, session_id, group, priority, request_id, attempt, current_carrier()
        )
        enqueued = await self._enqueue(request)
        granted = False
        waiter: _LocalWaiter | None = None
        key = (group, job)
        try:
            await self._mirror.wait_for_revision(enqueued.revision, MIRROR_LAG_TIMEOUT)
            if enqueued.epoch:
                # Granted by the enqueue itself: a hold with nothing waited, restored or moved.
                granted = True  # from here on, the API gives back a grant it cannot deliver
                yield Progress(
                    AcquireStage.GRANTED,
                    epoch=enqueued.epoch,
                    ticket=enqueued.entry_revision,
                    attempt=attempt,
                    warning=warning(group),
                )
                return
            topic = group_topic(group)
            last: tuple[AcquireStage, int] | None = None
            waiter = _LocalWaiter(
                enqueued.entry_revision, attempt, asyncio.get_running_loop().create_future()
            )
            self._waiting[key] = waiter
            self._metrics.waiters.inc()
            while True:
                if waiter.granted.done():
                    granted = True
                    yield dataclasses.replace(
                        waiter.granted.result(),
                        attempt=attempt,
                        warning=warning(group),
                    )
                    return
                seen = self._mirror.version(topic)
                view = self._mirror.group(group)
                progress = dataclasses.replace(
                    self._progress(view, session_id, job, enqueued.entry_revision),
                    ticket=enqueued.entry_revision,
                    attempt=attempt,
                )
                if progress.stage is AcquireStage.GRANTED:
                    granted = True
                    log.debug("%s granted %s after %.3f s", job, group, time.monotonic() - started)
                    yield dataclasses.replace(progress, warning=warning(group))
                    return
                if (progress.stage, progress.position) != last:
                    last = (progress.stage, progress.position)
                    yield progress
                await self._wait(topic, seen, waiter.granted)
        finally:
            if waiter is not None:
                waiter.ended.set()
                if self._waiting.get(key) is waiter:
                    del self._waiting[key]
                self._metrics.waiters.dec()
            if not granted and not self.draining:
                await run_to_completion(self._store.withdraw(enqueued))

    async def _enqueue(self, request: EnqueueRequest) -> Enqueued:
        """Take the group (free and nobody waiting) or queue for it, cancel-safe.

        The call's stream can end while the write is in flight (the client's deadline, a
        reset). The write then still commits, and nobody would wait for what it wrote: a
        hold or queue entry on the client's live session would block the group until the
        session ends. So a caller that leaves meanwhile waits for the write to finish and
        withdraws it before it goes.
        """
        writing = asyncio.ensure_future(self._write_entry(request))
        try:
            return await asyncio.shield(writing)
        except asyncio.CancelledError:
            await run_to_completion(self._withdraw_once_written(writing))
            raise

    async def _write_entry(self, request: EnqueueRequest) -> Enqueued:
        enqueued = await self._take_free(request)
        if enqueued is None:
            holder = Hint(self._mirror.holder(request.group))
            enqueued = await self._store.enqueue(request, holder)
        return enqueued

    async def _withdraw_once_written(self, writing: asyncio.Future[Enqueued]) -> None:
        try:
            enqueued = await writing
        except Exception:
            return  # nothing written; or unknown, and the client's retry re-attaches to it
        if not self.draining:
            await self._store.withdraw(enqueued)

    async def _wait(self, topic: str, seen: int, granted: asyncio.Future[Progress]) -> None:
        """Until the group changes in the mirror, or a hand-over here grants the waiter."""
        change = asyncio.ensure_future(self._mirror.wait_for_change(topic, seen))
        try:
            await asyncio.wait((change, granted), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not change.done():
                change.cancel()
        if change.done() and not change.cancelled():
            change.result()  # raise what the wait raised

    async def _take_free(self, request: EnqueueRequest) -> Enqueued | None:
        """Grant at once when the group is free and nobody waits: one transaction instead of
        a queue entry, a hop to the driver and its grant. None when the driver has work to
        do first, or the group is no longer as this replica saw it (then the job queues)."""
        released = self._released.pop(request.group, 0)
        if released > self._mirror.revision:
            await self._mirror.wait_for_revision(released, MIRROR_LAG_TIMEOUT)
        view = self._mirror.group(request.group)
        resident = resident_after_grant(view, request.job, self._mirror.agents())
        if resident is None:
            return None
        stats = view.stats
        stats.grants += 1
        free = FreeGroup(
            ticket=view.revision,
            resident=changed(view, resident),
            resident_revision=view.resident_revision,
            stats=stats,
            stats_revision=view.stats_revision,
            members_revision=view.members_revision,
        )
        enqueued = await self._store.take_free(request, free)
        if enqueued is not None:
            # What the driver counts for a grant in place; nobody waited.
            self._metrics.grants.labels(kind="in_place").inc()
            self._metrics.acquire_wait_seconds.observe(0.0)
        return enqueued

    def _progress(
        self, view: GroupView, session_id: str, job: str, entry_revision: int
    ) -> Progress:
        holder = view.holder
        if (
            holder is not None
            and holder.record.job == job
            and holder.record.session == session_id
            and hold_epoch(holder) > entry_revision
        ):
            h = holder.record
            return Progress(
                AcquireStage.GRANTED,
                epoch=hold_epoch(holder),
                waited_seconds=h.waited_seconds,
                restored=h.restored,
                previous_job=h.previous_job,
                switch_seconds=h.switch_seconds,
            )
        fault = view.faults.get(job)
        if fault is not None and fault.create_revision > entry_revision:
            raise GroupFaulted(fault.record.reason)
        queued = view.queued(job)
        if queued is None or queued.revision != entry_revision:
            if self._mirror.session(session_id) is None:
                raise SessionExpired(f"session {session_id} expired while waiting for {view.group}")
            raise Cancelled(f"the queue entry of {job} in {view.group} was removed")
        switch = view.switch
        if switch is not None and switch.record.to_job == job:
            return Progress(AcquireStage.SWITCHING, 0)
        served = [q.job for q in order(self.policy, view)]
        return Progress(AcquireStage.QUEUED, served.index(job) if job in served else 0)

    async def release_unsent(self, group: str, job: str, session_id: str, grant: Progress) -> None:
        """Give back a grant the client never received (it left as the grant was sent),
        unless the client has re-attached to it through another attempt meanwhile."""
        if self.draining:
            return  # the client re-attaches elsewhere and gets this grant back
        hold = Hold(group, job, grant.epoch, session_id)
        try:
            released = await run_to_completion(self._store.release_undelivered(hold, grant.attempt))
            if released is not None:
                log.info(
                    "released undelivered grant of %s on %s (epoch %d)", job, group, grant.epoch
                )
        except NotHolder:
            pass  # re-stamped (the client re-attached to it) or released meanwhile
        except Exception:
            log.exception("could not release undelivered grant of %s on %s", job, group)

    async def release(
        self,
        session_id: str,
        job: str,
        group: str,
        epoch: int,
        *,
        secret: str,
        operator: bool = False,
    ) -> None:
        """Yield; then, if the next waiter's state is already where it runs, grant it here.

        The hold must be the session's (``secret`` proves the caller owns it). An empty
        ``session_id`` is the operator yield, by job and epoch alone: only with ``operator``
        (the caller proved an operator identity), else PermissionDenied.

        The hand-over saves the hop through the mirror to the driver and its pass: the
        waiter's grant commits before this call returns. It is an optimisation only; when
        it cannot be made (state must move, the group changed) the driver grants as usual.
        """
        validate_job_id(job)
        validate_group_id(group)
        if session_id:
            session = await self.authenticate(session_id, secret)
            if session.record.job != job:
                raise PermissionDenied(
                    f"session {session_id} belongs to job {session.record.job}, not {job}"
                )
        elif not operator:
            raise PermissionDenied(
                "a yield without a session is an operator yield: it needs an operator identity"
            )
        if epoch <= 0:
            raise InvalidArgument("epoch must be the positive fencing token of the grant")
        hold = Hold(group, job, epoch, session_id)
        if not self._mirror.has_waiters(group):
            await self._release(hold)
            return
        # Marked before the release is written: the driver sees that write too.
        with self.hand_overs.handing(group):
            answered = await self._release_and_hand_over(hold)
        if answered is not None:
            # The waiter's grant goes out before this yield's answer (both share this
            # replica's loop and often the caller's host): the hand-over is for the waiter.
            try:
                async with asyncio.timeout(_WAITER_FIRST_SECONDS):
                    await answered.ended.wait()
            except TimeoutError:
                pass  # its stream is slow to take the grant: answer the yield anyway

    async def _release(self, hold: Hold) -> None:
        revision = await self._store.release(
            hold, Hint(self._mirror.holder(hold.group)), Hint(self._mirror.usage(hold.group))
        )
        self._note_release(hold.group, revision)

    def _note_release(self, group: str, revision: int) -> None:
        """Remember the release's revision: this replica's next grant of the group in place
        waits until its mirror shows it (see _take_free)."""
        self._released[group] = revision
        if len(self._released) > _RELEASED_KEPT:
            seen = self._mirror.revision
            self._released = {g: r for g, r in self._released.items() if r > seen}

    async def _release_and_hand_over(self, hold: Hold) -> _LocalWaiter | None:
        """Release ``hold``, then grant the group's next waiter in place, as the driver
        would, if its state is already where it runs: in one transaction when the deployment
        allows it (store.handover), else one after the other. Every part of the group the
        grant relies on is compared, so a stale view costs only the two-step path, or the
        driver's usual pass.

        Returns the waiter answered here, if the grant went to an Acquire call on this replica.
        """
        group = hold.group
        features = self._mirror.features()
        if features is not None and features.record.one_transaction_hand_over:
            view = self._mirror.group(group)
            seen = view.holder
            if seen is not None and hold_epoch(seen) == hold.epoch:
                grant = self._next_grant(dataclasses.replace(view, holder=None))
                if grant is None:
                    # State must move (or nobody waits): the driver's work, after the release.
                    await self._release(hold)
                    return None
                # An unknown outcome (StoreUnavailable) is the yield's: the client retries,
                # and a retry that finds the hold gone or handed on is answered as done.
                epoch = await self._store.hand_over(hold, seen, view.usage, grant, features)
                if epoch is not None:
                    self._note_release(group, epoch)
                    self._metrics.hand_overs.labels(transactions="one").inc()
                    return self._granted(grant, epoch)
        await self._release(hold)
        # The mirror may not show the release yet: the view is the group after it.
        grant = self._next_grant(dataclasses.replace(self._mirror.group(group), holder=None))
        if grant is None:
            return None
        try:
            epoch = await self._store.grant(None, grant)
        except StoreUnavailable as exc:
            log.info("group %s: no hand-over on yield (%s); the driver grants", group, exc)
            return None
        if epoch is None:
            return None
        self._metrics.hand_overs.labels(transactions="two").inc()
        return self._granted(grant, epoch)

    def _next_grant(self, view: GroupView) -> Grant | None:
        """The grant in place of the group's next waiter (``view``: the group after the
        release), or None when its state must move first (the driver's work) or nobody waits."""
        if not view.queue:
            return None  # the waiter left meanwhile
        head = order(self.policy, view)[0]
        residency = in_place(view, head.job, self._mirror.agents())
        if residency is None:
            return None
        holder = holder_for(head)
        stats = view.stats
        stats.grants += 1
        return Grant(
            view.group,
            head,
            holder,
            changed(view, residency),
            view.resident_revision,
            stats,
            stats_revision=view.stats_revision,
        )

    def _granted(self, grant: Grant, epoch: int) -> _LocalWaiter | None:
        """Count a grant made on yield, and answer its waiter if it waits on this replica."""
        head, holder = grant.waiter, grant.holder
        self._metrics.grants.labels(kind="on_yield").inc()
        self._metrics.acquire_wait_seconds.observe(holder.waited_seconds)
        waiter = self._waiting.get((grant.group, head.job))
        if (
            waiter is not None
            and waiter.entry_revision == head.revision
            and waiter.attempt == holder.attempt
            and not waiter.granted.done()
        ):
            waiter.granted.set_result(
                Progress(
                    AcquireStage.GRANTED,
                    epoch=epoch,
                    waited_seconds=holder.waited_seconds,
                    previous_job=holder.previous_job,
                    ticket=head.revision,
                )
            )
            return waiter
        return None

    async def set_members(self, group: str, nodes: list[str]) -> None:
        """Pin ``nodes`` to ``group`` (an empty list unpins).

        Refused: a node whose agent never connected (FailedPrecondition: a typo or a
        made-up name would block every switch of the group until unpinned); too many nodes is
        the quota's (``--max-members``). Nodes pinned already stay allowed, so that an
        operator can always shrink a list whose node was decommissioned.
        """
        validate_group_id(group)
        nodes = sorted(set(nodes))
        for node in nodes:
            validate_node(node)
        seen = set(self._mirror.agents()) | set(self._mirror.group(group).static_members)
        unseen = [n for n in nodes if n not in seen]
        if unseen:
            unknown = sorted(set(unseen) - await self._store.known_nodes(unseen))
            if unknown:
                raise FailedPrecondition(
                    f"cannot pin node(s) {', '.join(unknown[:10])}"
                    f"{' and more' if len(unknown) > 10 else ''} to {group}: "
                    "no agent for them ever connected"
                )
        revision = await self._store.set_members(group, nodes)
        # The caller reads its own write back from the mirror.
        await self._mirror.wait_for_revision(revision, MIRROR_LAG_TIMEOUT)

    def view(self, group: str) -> GroupView:
        validate_group_id(group)
        view = self._mirror.group(group)
        if not view.exists:
            raise NotFound(f"group {group} does not exist")
        return view
