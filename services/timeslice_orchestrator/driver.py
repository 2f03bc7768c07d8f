"""The switch driver: hands a group to its next waiter, moving device state when it must.

Each replica's driver drives the groups whose driver key it holds (claiming a free key when a
group needs driving). A change to a group, or to the agents, adds the group to a rate-limited
work queue (:mod:`.workqueue`) whose workers run one reconcile pass at a time per group. A pass
is level-triggered: it reads the group from the mirror and takes the one step it calls for, top
to bottom:

    another live replica drives it      -> nothing to do (checked before anything is written)
    a yield here is handing it over     -> nothing to do (looked at again when that ends)
    switch record present               -> carry it on from its phase (ours in flight, or left
                                           by a driver that died)
    holder present, a node came back    -> catch-up: restore the holder on the nodes that
      without its state                    lack its state (a switch beside it, no grant)
    operator operation pending, and a   -> run the oldest: a switch on its node that evicts
      holder or no waiter                  (snapshot) or restores (restore) the job and ends
                                           without a grant, writing the operation's outcome
    queue empty                         -> nothing to do
    holder present                      -> nothing to do (lazy: no data moves on yield), or
                                           prefetch the next waiter beside it if it fits
                                           (one that fails is retried with backoff, and
                                           never faults the waiter)
    a waiter parked on a node that      -> held back (the next waiter in line is served
      cannot restore it (agent away)       instead), with the reason in last_error; faulted
                                           once that lasts past its deadline
    head's last switch failed just now  -> wait until its retry is due
    head's state already on its nodes   -> grant at once (no data movement)
    otherwise                           -> CHECKPOINT the residents on every node concurrently,
                                           then RESTORE the head on every node concurrently,
                                           then commit resident + holder in one transaction.

A failed checkpoint rolls back (nodes that checkpointed restore their job) and retries with
backoff: when it failed in the evicted job's own hook or backend, that job is faulted (when it
waits), never the head, which is granted once that state is off the devices. A refused one
(host memory, a safety check) is retried a bounded number of times, then the head alone is
faulted, as after a failed restore; the group goes on serving the others.

A node that stops answering (silent past the agent liveness timeout, or past a directive's
deadline) is fenced out (``docs/fencing.md``): the switch record lists it, it is sent nothing
more of the switch, its residency is unknown, and the switch completes on the nodes that
answer, with the reason in the group's ``last_error``. No phase waits for it to come back.
But a job whose state is parked on a node that cannot restore it (its agent away, or back
without the job's workers yet) is never granted: its processes there would stay parked
(stopped, for the freeze backend) while it is told it holds the group. A switch towards it
that went on without such a node ends without a grant, and the job is held back until the
node has restored it, for at most ``parked_wait`` seconds; then it is faulted with the reason.
Other waiters are served meanwhile.

Operator operations (snapshot / restore of one job on one node, docs/llmd-agent.md) never
interleave with a switch: one runs only when no switch record exists, and it is a switch
record itself, so it is fenced and carried on after a driver crash like any switch. On a free
group a waiter keeps priority (an acquire blocks a job; an operation is maintenance): the
operation waits for the grant and is then decided against the group as it is.

A pass never sleeps: it says what should happen next (:class:`Next`) and the work queue brings
the group back at once, after a backoff, or when a retry is due.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import Tracer

from timeslice_orchestrator.directives import DirectiveSender, NodeResult
from timeslice_orchestrator.grants import HandOvers, changed, holder_for, in_place
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.policy import Policy, order
from timeslice_orchestrator.relay import DirectiveRouter
from timeslice_orchestrator.retries import Retry, RetryLedger
from timeslice_orchestrator.store.etcd import StoreUnavailable
from timeslice_orchestrator.store.follower import MIRROR_LAG_TIMEOUT, Mirror
from timeslice_orchestrator.store.groups import Authority, Fault, Grant, GroupStore, new_switch_id
from timeslice_orchestrator.store.mirror import AGENTS_TOPIC, GroupView
from timeslice_orchestrator.store.records import (
    AgentRecord,
    NodeStep,
    OperationKind,
    OperationRecord,
    OperationState,
    QueuedJob,
    ResidentRecord,
    Stored,
    SwitchPhase,
    SwitchRecord,
    hold_epoch,
)
from timeslice_orchestrator.switch_plan import plan, plan_operation, stranded
from timeslice_orchestrator.workqueue import KeyedBackoff, WorkQueue
from timeslice_proto.timeslice.v1 import DirectiveKind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DriverConfig:
    """How one replica's driver behaves (times in seconds)."""

    replica_id: str
    directive_timeout: float = 30.0
    max_attempts: int = 3  # refused switches tried towards one waiter before it is faulted
    retry_backoff: float = 0.2  # first backoff, of a blocked group and of a failed switch
    max_backoff: float = 2.0  # cap of a blocked group's backoff
    idle_recheck: float = 2.0  # an idle group with waiters is looked at again this often
    co_residency: bool = False
    prefetch: bool = False
    policy: Policy = Policy.FIFO
    # Groups driven at once. A pass can wait on agents up to the directive timeout, so this is
    # generous: enough that switches of unrelated groups rarely wait for each other.
    workers: int = 64
    # How long a waiter parked on a node that cannot restore it (its agent away) is held back
    # before it is faulted; None: the directive timeout (what a restore there may take).
    parked_wait: float | None = None

    @property
    def held_back_for(self) -> float:
        """Seconds a waiter is held back for a node that cannot restore it, at most."""
        return self.directive_timeout if self.parked_wait is None else self.parked_wait


class Next(enum.Enum):
    """What happens to a group after one reconcile pass."""

    IDLE = "idle"  # nothing to do until the group changes
    AGAIN = "again"  # progress was made: look again at once
    LATER = "later"  # blocked (an agent away, a lost race): retry after the group's backoff
    WAIT = "wait"  # the head's last switch failed: look again when its retry is due


class SwitchFailed(Exception):
    """A switch phase failed on some nodes."""

    def __init__(self, phase: SwitchPhase, failures: Sequence[NodeResult]) -> None:
        self.phase = phase
        self.failures = list(failures)
        detail = "; ".join(f"{f.node}: {f.error}" for f in failures)
        super().__init__(f"{phase.value} failed on {len(failures)} node(s): {detail}")


class SwitchDriver:
    """Drives the switches of the groups whose driver key this replica holds."""

    def __init__(
        self,
        store: GroupStore,
        mirror: Mirror,
        router: DirectiveRouter,
        metrics: Metrics,
        config: DriverConfig,
        lease: int,
        tracer: Tracer | None = None,
        hand_overs: HandOvers | None = None,
    ) -> None:
        self._store = store
        self._hand_overs = hand_overs or HandOvers()
        self._mirror = mirror
        self._metrics = metrics
        self._config = config
        self._auth = Authority(config.replica_id, lease)
        self._tracer = tracer or trace.NoOpTracer()
        self._directives = DirectiveSender(
            router, mirror, metrics, self._tracer, config.directive_timeout
        )
        self._queue: WorkQueue[str] = WorkQueue(
            self._sync,
            workers=config.workers,
            backoff=KeyedBackoff(config.retry_backoff, config.max_backoff),
            name="driver",
            on_error=self._pass_failed,
        )
        self.retries = RetryLedger()
        """Failed switches, catch-ups and prefetches of live holds and waiters."""
        self.held_back = RetryLedger()
        """Waiters held back for a node that cannot restore them: ``due`` is their deadline."""
        self._last_error: dict[str, str] = {}
        # The revision of this driver's last write to each group, until the mirror shows it:
        # a pass planned on an older view would carry on a switch it has just committed.
        self._written: dict[str, int] = {}

    # -- wiring -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the workers and look once at every group with something to do."""
        self._mirror.add_listener(self._on_change)
        self._hand_overs.add_listener(self.kick)
        self._queue.start()
        self._kick_busy(self._mirror.group_names())

    async def stop(self) -> None:
        """Stop driving: passes in flight are cancelled (a switch record carries them on)."""
        self._mirror.remove_listener(self._on_change)
        self._hand_overs.remove_listener(self.kick)
        await self._queue.shutdown()

    def kick(self, group: str) -> None:
        """Look at ``group`` as soon as a worker is free."""
        self._queue.add(group)

    def _kick_busy(self, groups: Iterable[str]) -> None:
        # A pass over an idle group does nothing (see reconcile), and a deployment can have
        # 100,000 of them: at start, on a re-list or when an agent changes, only the groups
        # with a waiter or a switch are queued.
        for group in groups:
            if self._mirror.needs_driver(group):
                self.kick(group)

    def _on_change(self, topics: set[str]) -> None:
        if AGENTS_TOPIC in topics:
            self._kick_busy(self._mirror.group_names())
        groups = [topic[6:] for topic in topics if topic.startswith("group:")]
        if self._written:
            # Writes the mirror now shows need no wait (a group gone idle keeps no entry).
            revision = self._mirror.revision
            for group in groups:
                if self._written.get(group, revision + 1) <= revision:
                    del self._written[group]
        self._kick_busy(groups)

    async def _sync(self, group: str) -> None:
        """The work queue's handler: one pass over ``group``, then when to look again."""
        try:
            step = await self.reconcile(group)
        except StoreUnavailable as exc:
            log.warning("group %s: etcd unavailable (%s); retrying", group, exc)
            step = Next.LATER
        if step is Next.LATER:
            self._queue.add_rate_limited(group)
            return
        self._queue.forget(group)
        if step is Next.AGAIN:
            self._queue.add(group)
        elif step is Next.WAIT:
            self._queue.add_after(group, self.retries.wait(group))
        elif self._has_work(group):
            # A safety net: a group with waiters is looked at now and then even if nothing
            # about it changes.
            self._queue.add_after(group, self._config.idle_recheck)

    def _pass_failed(self, group: str, exc: BaseException) -> None:
        # A bug, not an outage: the work queue logged it and retries the group with backoff.
        self._metrics.driver_errors.inc()

    def _has_work(self, group: str) -> bool:
        return not self._mirror.idle(group)

    # -- one pass -----------------------------------------------------------------------

    async def reconcile(self, group: str) -> Next:
        """Take the one step ``group`` calls for (the table in the module docstring)."""
        written = self._written.get(group, 0)
        if written > self._mirror.revision:
            await self._mirror.wait_for_revision(written, MIRROR_LAG_TIMEOUT)
        self._written.pop(group, None)
        if not self._mirror.needs_driver(group):
            self.retries.forget_group(group)
            self.held_back.forget_group(group)
            return Next.IDLE  # no switch, nobody waits (decided without decoding a record)
        if group in self._hand_overs:
            return Next.IDLE  # a yield here is granting the next waiter; kicked when it ends
        view = self._mirror.group(group)
        hold = (view.holder.record.job, hold_epoch(view.holder)) if view.holder else None
        self.retries.forget_ended(group, ((q.job, q.revision) for q in view.queue), hold)
        self.held_back.forget_ended(group, ((q.job, q.revision) for q in view.queue), None)
        if view.switch is not None:
            # Ours in flight, or left by a driver that died: carry it on from its phase.
            if not await self._drives(view):
                return Next.IDLE
            return await self._advance(view.switch)
        if view.holder is not None:
            caught_up = await self._catch_up(view)
            if caught_up is not None:
                return caught_up
        operation = view.pending_operation()
        if operation is not None and (view.holder is not None or not view.queue):
            return await self._operate(view, operation)
        if not view.queue:
            return Next.IDLE
        ordered = order(self._config.policy, view)
        if view.holder is not None:
            return await self._prefetch(view, ordered[0])
        if not await self._drives(view):
            return Next.IDLE
        agents = self._mirror.agents()
        missing = [n for n in view.static_members if n not in agents]
        if missing:
            # A pinned node must take part in every switch: wait for its agent to come back,
            # and say why in the group's last_error (status shows it to whoever waits). The
            # note is written, and logged, only when it changes: this path comes back often.
            note = f"waiting for pinned node(s) {', '.join(missing)}: no agent connected"
            if view.stats.last_error != note and await self._store.note_error(group, note):
                log.warning("group %s: %s", group, note)
            return Next.LATER
        servable = await self._hold_back(view, ordered, agents)
        if isinstance(servable, Next):
            return servable
        head = servable
        steps = plan(view, head.job, agents, self._config.co_residency)
        assert steps is not None  # nothing is protected without a holder
        if not steps:
            return await self._grant_in_place(view, head)
        retry = self.retries.get((group, head.job, head.revision))
        if retry is not None and retry.due > time.monotonic():
            return Next.WAIT  # its last switch failed and rolled back just now
        attempt = retry.attempts + 1 if retry is not None else 1
        return await self._begin(view, head.job, head.revision, steps, attempt)

    async def _hold_back(
        self, view: GroupView, ordered: list[QueuedJob], agents: dict[str, AgentRecord]
    ) -> QueuedJob | Next:
        """The first waiter in ``ordered`` that may be served, holding back those parked on a
        node that cannot restore them (:func:`stranded`); or what to do when none may.

        A held-back waiter's reason goes into ``last_error`` (written when it changes). One
        held back past its deadline (:attr:`DriverConfig.held_back_for`, from the first pass
        that held it back) is faulted: its acquire fails with the reason. The node's return
        changes the agents, which brings the group back here at once.
        """
        group = view.group
        if view.resident is None or not view.resident.record.parked:
            return ordered[0]  # nothing is parked anywhere (the common case)
        residency = view.resident.record
        now = time.monotonic()
        wait = self._config.held_back_for
        first: QueuedJob | None = None
        notes: list[str] = []
        for waiter in ordered:
            key = (group, waiter.job, waiter.revision)
            nodes = stranded(residency, group, waiter.job, agents, view.static_members)
            if not nodes:
                self.held_back.pop(key)
                first = first or waiter
                continue
            since = self.held_back.get(key)
            if since is None:
                since = Retry(0, now + wait)
                self.held_back.put(key, since)
                log.warning(
                    "group %s: %s held back: parked on %s, which cannot restore it now",
                    group,
                    waiter.job,
                    ", ".join(nodes),
                )
            if since.due <= now:
                return await self._give_up_parked(view, waiter, nodes, wait)
            notes.append(_held_back_note(waiter.job, nodes, wait))
        if notes:
            note = "; ".join(notes)
            if view.stats.last_error != note and await self._store.note_error(group, note):
                log.info("group %s: %s", group, note)
            view.stats.last_error = note  # kept by a grant this pass writes
        return first if first is not None else Next.LATER

    async def _give_up_parked(
        self, view: GroupView, waiter: QueuedJob, nodes: list[str], wait: float
    ) -> Next:
        """Fault a waiter held back past its deadline for a node that cannot restore it."""
        where = ", ".join(nodes)
        reason = (
            f"{waiter.job} is parked on {where} (its processes there stopped or its state off "
            f"the devices) and {where} could not restore it for {wait:g} s: the node's agent "
            f"is away, or lists no worker of {waiter.job}; {waiter.job} is not granted "
            f"without it (acquire again once {where} is back)"
        )
        stats = view.stats
        stats.last_error = reason
        stats.faults += 1
        self.held_back.pop((view.group, waiter.job, waiter.revision))
        faulted = await self._store.fault_waiter(
            view.group, self._auth, Fault(waiter, reason), stats
        )
        if self._wrote(view.group, faulted) is not None:
            log.error("group %s: %s isolated: %s", view.group, waiter.job, reason)
            self._metrics.switches.labels(outcome="held_back_too_long").inc()
        return Next.AGAIN

    async def _drives(self, view: GroupView) -> bool:
        """Whether this replica drives ``view``'s group, claiming the role if it is free."""
        group = view.group
        if view.driver is not None and view.driver_lease != self._auth.lease:
            return False  # another live replica drives this group
        if view.driver is None and not await self._store.claim_driver(group, self._auth):
            return False
        return True

    async def _catch_up(self, view: GroupView) -> Next | None:
        """Restore the holder on a node that came back without its state (fenced, or its
        agent away, when the hold was granted): a switch beside the hold, towards the holder
        itself, that ends without a grant. None when its state is everywhere it runs.

        Each hold's catch-up starts at most once per backoff (doubling from
        ``retry_backoff`` up to ``max_backoff``) and ``max_attempts`` times in all, so a node
        that keeps failing it is not hammered; then ``last_error`` says so and the holder's
        state reaches that node at its next switch.
        """
        holder = view.holder
        assert holder is not None
        job, epoch = holder.record.job, hold_epoch(holder)
        key = (view.group, job, epoch)
        steps = plan(view, job, self._mirror.agents(), self._config.co_residency)
        if not steps:
            self.retries.pop(key)
            return None
        retry = self.retries.get(key)
        now = time.monotonic()
        attempt = retry.attempts + 1 if retry is not None else 1
        if attempt > self._config.max_attempts:
            return None  # given up on this hold (said once, below)
        if retry is not None and retry.due > now:
            return Next.WAIT
        if not await self._drives(view):
            return Next.IDLE
        if attempt == self._config.max_attempts:
            nodes = ", ".join(sorted({s.node for s in steps}))
            self._last_error[view.group] = (
                f"holder {job} could not be restored on {nodes} after {attempt} attempts; "
                "it gets its state there at its next switch"
            )
        backoff = min(self._config.retry_backoff * 2 ** (attempt - 1), self._config.max_backoff)
        self.retries.put(key, Retry(attempt, now + backoff))
        return await self._begin(view, job, epoch, steps, attempt)

    async def _prefetch(self, view: GroupView, head: QueuedJob) -> Next:
        """While the holder runs, bring the next waiter's state in if it fits beside it.

        Paced like a catch-up: each hold's prefetch of a waiter starts at most once per
        backoff and ``max_attempts`` times in all. Its end changes the group, which brings
        it straight back here, so a prefetch that keeps failing would otherwise be tried
        again at once for as long as the hold lasts; the switch will do the work anyway.
        """
        if not self._config.prefetch or view.holder is None:
            return Next.IDLE
        # Keyed by the hold's epoch, not the waiter's entry: the switch's own retries of the
        # waiter (and when it is faulted) must not count the prefetches' failures.
        key = (view.group, head.job, hold_epoch(view.holder))
        steps = plan(
            view, head.job, self._mirror.agents(), co_residency=True,
            protect=view.holder.record.job,
        )  # fmt: skip
        if not steps:
            self.retries.pop(key)
            return Next.IDLE  # already resident, or it does not fit beside the holder
        retry = self.retries.get(key)
        now = time.monotonic()
        attempt = retry.attempts + 1 if retry is not None else 1
        if attempt > self._config.max_attempts:
            return Next.IDLE  # given up for this hold: the switch will do it
        if retry is not None and retry.due > now:
            return Next.WAIT
        if not await self._drives(view):
            return Next.IDLE
        backoff = min(self._config.retry_backoff * 2 ** (attempt - 1), self._config.max_backoff)
        self.retries.put(key, Retry(attempt, now + backoff))
        return await self._begin(view, head.job, head.revision, steps, attempt)

    async def _operate(self, view: GroupView, operation: Stored[OperationRecord]) -> Next:
        """Run an operator operation: decide it against the group as it is now, then close it
        at once (nothing to move, or no longer allowed) or begin its switch."""
        if not await self._drives(view):
            return Next.IDLE
        op = operation.record
        steps = plan_operation(view, op, self._mirror.agents(), self._config.co_residency)
        if isinstance(steps, str) or not steps:
            failed = isinstance(steps, str)
            outcome = dataclasses.replace(
                op,
                state=OperationState.FAILED if failed else OperationState.SUCCEEDED,
                error=steps if isinstance(steps, str) else "",
                finished_at=time.time(),
            )
            written = await self._store.finish_operation(self._auth, operation, outcome)
            if self._wrote(view.group, written) is not None:
                self._metrics.switches.labels(outcome="operation").inc()
                log.info(
                    "group %s: operation %s (%s of %s on %s) %s%s",
                    view.group,
                    op.operation_id,
                    op.kind.value,
                    op.job,
                    op.node,
                    outcome.state.value,
                    f": {outcome.error}" if failed else " (nothing to move)",
                )
            return Next.AGAIN
        # A restore's job is the switch's destination; a snapshot has none.
        to_job = op.job if op.kind is OperationKind.RESTORE else ""
        # Revision 0 names no queue entry: the switch ends without a grant.
        return await self._begin(view, to_job, 0, steps, 1, operation)

    async def _begin(
        self,
        view: GroupView,
        to_job: str,
        to_revision: int,
        steps: list[NodeStep],
        attempt: int,
        operation: Stored[OperationRecord] | None = None,
    ) -> Next:
        """Write the switch record towards ``to_job``, then drive it.

        With the group free this is a switch (``to_revision``: the waiter's queue entry);
        beside a holder it is a prefetch of a waiter, or the catch-up of the holder itself
        (``to_revision``: its epoch), which move only what fits next to the hold and end
        without a grant. With ``operation`` it carries out that operator operation (no
        waiter: ``to_revision`` 0), beside the holder or on the free group, without a grant.
        """
        group = view.group
        record = SwitchRecord(
            switch_id=new_switch_id(),
            group=group,
            to_job=to_job,
            to_revision=to_revision,
            steps=steps,
            phase=SwitchPhase.CHECKPOINT,
            driver=self._config.replica_id,
            started_at=time.time(),
            attempt=attempt,
            prefetch=view.holder is not None,
            operation=operation.record.operation_id if operation is not None else "",
        )
        # The record's create revision is the epoch of every directive of the switch. Beside
        # a holder (a prefetch, a catch-up, an operation) the holder must not change meanwhile.
        switch = await self._store.begin_switch(
            group,
            self._auth,
            record,
            view.resident_revision,
            view.holder.mod_revision if view.holder is not None else 0,
            operation,
        )
        if switch is None:
            return Next.AGAIN  # the group changed underneath; look again
        self._wrote(group, switch.mod_revision)
        if operation is not None:
            op = operation.record
            log.info(
                "group %s: operation %s: %s of %s on %s, epoch %d",
                group,
                op.operation_id,
                op.kind.value,
                op.job,
                op.node,
                switch.create_revision,
            )
        elif view.holder is not None and view.holder.record.job == to_job:
            nodes = ", ".join(sorted({s.node for s in steps}))
            log.info("group %s: restoring holder %s on %s (catch-up)", group, to_job, nodes)
        elif view.holder is not None:
            log.info("group %s: prefetching %s beside %s", group, to_job, view.holder.record.job)
        else:
            log.info(
                "group %s: switch %s -> %s on %d node(s), epoch %d (attempt %d)",
                group,
                ",".join(record.from_jobs) or "-",
                to_job,
                len(steps),
                switch.create_revision,
                attempt,
            )
        return await self._advance(switch)

    async def _grant_in_place(self, view: GroupView, head: QueuedJob) -> Next:
        residency = in_place(view, head.job, self._mirror.agents())
        if residency is None:
            return Next.AGAIN  # the agents changed since the plan: plan again
        holder = holder_for(head)
        stats = view.stats
        stats.grants += 1
        epoch = await self._store.grant(
            self._auth,
            Grant(
                view.group, head, holder, changed(view, residency), view.resident_revision, stats
            ),
        )
        if epoch is None:
            return Next.AGAIN
        self._wrote(view.group, epoch)
        self._metrics.grants.labels(kind="in_place").inc()
        self._metrics.acquire_wait_seconds.observe(holder.waited_seconds)
        return Next.IDLE

    # -- the switch, phase by phase --------------------------------------------------------

    async def _advance(self, switch: Stored[SwitchRecord]) -> Next:
        record = switch.record
        with self._tracer.start_as_current_span(
            "timeslice.switch",
            attributes={
                "timeslice.group": record.group,
                "timeslice.switch_id": record.switch_id,
                "timeslice.epoch": switch.create_revision,
                "timeslice.from_jobs": ",".join(record.from_jobs),
                "timeslice.to_job": record.to_job,
                "timeslice.nodes": len(record.steps),
                "timeslice.attempt": record.attempt,
                "timeslice.resumed_phase": record.phase.value,
                "timeslice.driver": self._config.replica_id,
            },
        ) as span:
            outcome = await self._advance_phases(switch)
            span.set_attribute("timeslice.next", outcome.value)
            return outcome

    async def _advance_phases(self, switch: Stored[SwitchRecord]) -> Next:
        """Drive a switch record from its current phase to its end.

        CHECKPOINT -> RESTORE -> commit on success; CHECKPOINT -> ROLLBACK -> end on a
        failure. Every directive id is fixed by (switch, phase, node), so carrying on after a
        driver crash re-sends the same ids and agents answer what they already did instead
        of doing it twice. An unreachable agent leaves the record in place (outcome unknown)
        and the pass is retried; a backend failure is final.
        """
        record = switch.record
        started = time.monotonic()
        if record.phase is SwitchPhase.CHECKPOINT:
            evictions = [s for s in record.steps if s.evict]
            results = await self._directives.fan_out(
                switch, DirectiveKind.CHECKPOINT, evictions, "evict"
            )
            fenced = self._note_fenced(record, results, "checkpoint")
            if any(r.unavailable for r in results):
                # Outcome unknown (the stream broke, the relay moved): keep the record, with
                # the nodes fenced meanwhile, and send the same directives again; the agents
                # answer what they already did. Rolling back now would race the checkpoint.
                if fenced:
                    kept = await self._store.update_switch(
                        record.group, self._auth, switch, record.phase
                    )
                    self._wrote(record.group, kept.mod_revision if kept else None)
                _retrying(record, "checkpoint", results)
                return Next.LATER
            failed = [r for r in results if r.failed]
            culprits = [
                _Culprit(step.evict, step.node, r.error)
                for step, r in zip(evictions, results, strict=True)
                # A refusal (host memory, safety) is the node's capacity, not the job's fault.
                if r.failed and not r.refused
            ]
            next_phase = SwitchPhase.ROLLBACK if failed else SwitchPhase.RESTORE
            if failed:
                error = SwitchFailed(SwitchPhase.CHECKPOINT, failed)
                log.warning("group %s: %s; rolling back", record.group, error)
                self._metrics.switches.labels(outcome="rolled_back").inc()
                previous = self._last_error.get(record.group)
                self._last_error[record.group] = f"{previous}; {error}" if previous else str(error)
            evicted = sum(r.bytes_moved for r in results if r.ok)
            moved = await self._store.update_switch(
                record.group, self._auth, switch, next_phase, evicted_bytes=evicted
            )
            if moved is None:
                return Next.AGAIN  # lost the driver role or raced: look again
            self._wrote(record.group, moved.mod_revision)
            switch, record = moved, moved.record
            if record.phase is SwitchPhase.ROLLBACK:
                return await self._roll_back(switch, culprits)
        if record.phase is SwitchPhase.RESTORE:
            return await self._restore_and_commit(switch, started)
        # Carried on after a driver died: whose checkpoint failed is not known any more.
        return await self._roll_back(switch, [])

    async def _restore_and_commit(self, switch: Stored[SwitchRecord], started: float) -> Next:
        record = switch.record
        group = record.group
        # Nodes gone before this phase: whether their checkpoint ran is not known.
        gone_in_checkpoint = set(record.fenced)
        restores = [s for s in record.steps if s.restore]
        results = await self._directives.fan_out(switch, DirectiveKind.RESTORE, restores, "restore")
        fenced = self._note_fenced(record, results, "restore")
        if any(r.unavailable for r in results):
            # Keep the record (with the nodes fenced meanwhile); the same directives go again.
            if fenced:
                kept = await self._store.update_switch(group, self._auth, switch, record.phase)
                self._wrote(group, kept.mod_revision if kept else None)
            _retrying(record, "restore", results)
            return Next.LATER
        view = self._mirror.group(group)
        resident = view.residency()
        self._forget_away(record, resident)
        for step in record.steps:
            if not step.evict:
                continue
            if step.node not in record.fenced:
                # Checkpointed: parked on the node (on its host, or its processes stopped).
                resident.park(step.node, step.evict)
            elif step.node not in gone_in_checkpoint and step.evict not in resident.nodes.get(
                step.node, []
            ):
                # Its checkpoint was acked before the node went, in this phase: parked there.
                # Otherwise a fenced node's residency is what its fence (or the hello that
                # reconciled it since) wrote, and the view read it as such.
                resident.park(step.node, step.evict)
        for step, result in zip(restores, results, strict=True):
            if result.ok:
                resident.place(step.node, record.to_job)
        stats = view.stats
        head = view.queued(record.to_job)
        if head is not None and head.revision != record.to_revision:
            head = None
        held: list[str] = []
        if head is not None and not record.prefetch and not record.operation:
            # Restored where it could be, but parked on a node that went (or is back without
            # its workers): it must not be told it holds the group while its processes there
            # stay parked. The switch ends without a grant; the next pass holds it back.
            held = stranded(
                resident, group, record.to_job, self._mirror.agents(), view.static_members
            )
        failed = [r for r in results if r.failed]
        if failed:
            error = SwitchFailed(SwitchPhase.RESTORE, failed)
            stats.last_error = f"{record.to_job}: {error}"
            # A prefetch is only an optimisation: its waiter keeps its place, and the switch
            # that serves it restores it again.
            fault = Fault(head, str(error)) if head is not None and not record.prefetch else None
            stats.faults += fault is not None
            ended = self._wrote(
                group,
                await self._store.end_switch(
                    group,
                    self._auth,
                    switch,
                    resident,
                    stats,
                    fault=fault,
                    resident_revision=view.resident_revision,
                    operation=_outcome(view, record, restores, results, str(error)),
                ),
            )
            if ended:
                self._metrics.switches.labels(outcome="restore_failed").inc()
                if record.prefetch and head is not None:
                    log.warning("group %s: prefetch of %s failed: %s", group, record.to_job, error)
                elif head is not None:
                    log.error("group %s: %s isolated: %s", group, record.to_job, error)
                else:
                    log.warning("group %s: restore of %s failed: %s", group, record.to_job, error)
            return Next.AGAIN
        if record.prefetch or head is None or held:
            # A prefetch ends here, and so does a switch whose waiter left, a catch-up and
            # an operator operation (no waiter): keep what the devices now hold, drop the
            # record (closing the operation with it); a grant (in place) comes on its own.
            if held:
                stats.last_error = _held_back_note(record.to_job, held, self._config.held_back_for)
                if group in self._last_error:
                    stats.last_error = f"{self._last_error.pop(group)}; {stats.last_error}"
                log.warning(
                    "group %s: switch %s ends without a grant: %s",
                    group,
                    record.switch_id,
                    stats.last_error,
                )
            ended = self._wrote(
                group,
                await self._store.end_switch(
                    group,
                    self._auth,
                    switch,
                    resident,
                    stats,
                    resident_revision=view.resident_revision,
                    operation=_outcome(view, record, restores, results),
                ),
            )
            if ended:
                outcome = "prefetched" if record.prefetch else "waiter_left"
                if record.operation:
                    outcome = "operation"
                elif held:
                    outcome = "held_back"
                self._metrics.switches.labels(outcome=outcome).inc()
            return Next.AGAIN
        elapsed = max(time.monotonic() - started, time.time() - record.started_at)
        holder = holder_for(
            head,
            # A job's first switch has nothing to restore (its state never left): not restored.
            restored=any(r.moved for r in results),
            previous=",".join(record.from_jobs),
            switch_seconds=elapsed,
        )
        stats.switches += 1
        stats.grants += 1
        stats.last_switch_seconds = elapsed
        if group in self._last_error:
            stats.last_error = self._last_error.pop(group)
        committing = time.monotonic()
        epoch = await self._store.grant(
            self._auth, Grant(group, head, holder, resident, view.resident_revision, stats, switch)
        )
        self._metrics.switch_phase_seconds.labels(phase="commit").observe(
            time.monotonic() - committing
        )
        self._wrote(group, epoch)
        if epoch is None:
            # The mirror lagged or the waiter re-attached: retry the commit.
            log.info(
                "group %s: commit of switch %s to %s did not go through (the group changed "
                "or this replica's view lags); retrying",
                group,
                record.switch_id,
                head.job,
            )
            return Next.LATER
        self.retries.pop((group, head.job, head.revision))
        self._metrics.switches.labels(outcome="committed").inc()
        self._metrics.switch_seconds.observe(elapsed)
        self._metrics.grants.labels(kind="switch").inc()
        self._metrics.acquire_wait_seconds.observe(holder.waited_seconds)
        log.info(
            "group %s: granted %s epoch %d after %.3f s switch", group, head.job, epoch, elapsed
        )
        return Next.IDLE

    async def _roll_back(self, switch: Stored[SwitchRecord], culprits: list[_Culprit]) -> Next:
        """Put every evicted job back where it was, then close the record.

        ``culprits``: the evicted jobs whose checkpoint failed (empty when not known)."""
        record = switch.record
        group = record.group
        evictions = [s for s in record.steps if s.evict]
        results = await self._directives.fan_out(
            switch, DirectiveKind.RESTORE, evictions, "rollback"
        )
        fenced = self._note_fenced(record, results, "rollback")
        if any(r.unavailable for r in results):
            if fenced:
                kept = await self._store.update_switch(group, self._auth, switch, record.phase)
                self._wrote(group, kept.mod_revision if kept else None)
            _retrying(record, "rollback", results)
            return Next.LATER
        view = self._mirror.group(group)
        resident = view.residency()
        self._forget_away(record, resident)
        stats = view.stats
        stats.last_error = self._last_error.pop(group, "") or f"switch {record.switch_id} aborted"
        stats.rollbacks += 1
        for step, result in zip(evictions, results, strict=True):
            if result.gone:
                continue  # said once, in last_error
            if not result.ok:
                resident.park(step.node, step.evict)  # its checkpoint stands: parked there
                stats.last_error += f"; rollback on {step.node} failed: {result.error}"
            elif step.evict not in resident.nodes.get(step.node, []):
                # Back on the devices, whatever the residency says: the node's agent may have
                # reconnected between checkpoint and rollback and reported the job parked
                # (which it then was). Left out, the next switch would not checkpoint it.
                resident.place(step.node, step.evict)
        ended = await self._store.end_switch(
            group,
            self._auth,
            switch,
            resident,
            stats,
            resident_revision=view.resident_revision,
            operation=_outcome(view, record, [], [], stats.last_error),
        )
        if not self._wrote(group, ended):
            return Next.AGAIN
        return await self._after_abort(group, record, culprits)

    def _wrote(self, group: str, revision: int | None) -> int | None:
        """Remember a write of this pass (None: it did not go through); returns it."""
        if revision is not None:
            self._written[group] = max(revision, self._written.get(group, 0))
        return revision

    async def _after_abort(
        self, group: str, record: SwitchRecord, culprits: list[_Culprit]
    ) -> Next:
        """After a failed checkpoint: fault the job whose state could not leave, never the
        waiter, which keeps its place and is retried with backoff.

        Only an evicted job's state was being moved: its hook, its processes or its node
        failed, not the waiter. Faulting the waiter (as before) let the job whose state can
        not move keep the group: once the waiter was gone, its next acquire was granted in
        place. So the job itself is faulted when it waits (its acquire fails with
        GroupFaulted and the reason); one that does not wait yet is faulted at the first
        retry that finds it queued. The waiter is granted as soon as that state is off the
        devices: a retry whose checkpoint works, or the job's workers gone (no longer
        resident, so nothing to move); until then the group's ``last_error`` says why it
        waits. Granting it beside the stuck state instead could run a device out of memory.
        """
        if record.prefetch:
            return Next.IDLE  # an optimisation that did not work out: the switch will do it
        if record.operation:
            return Next.AGAIN  # its outcome (failed) is written; operations are not retried
        key = (group, record.to_job, record.to_revision)
        retry = self.retries.get(key)
        attempt = max(retry.attempts if retry is not None else 0, record.attempt)
        if not culprits:
            return await self._give_up_later(group, record, attempt)
        # Not a sleep: the next pass finds the retry not yet due and the work queue brings
        # the group back when it is (our own writes kick it earlier in vain). Unbounded in
        # number, so the exponent is: a float overflows past 2**1023.
        doubled = self._config.retry_backoff * 2 ** min(attempt - 1, 30)
        backoff = min(doubled, self._config.max_backoff)
        self.retries.put(key, Retry(attempt, time.monotonic() + backoff))
        written = self._written.get(group, 0)
        if written > self._mirror.revision:
            # Read the group as the rollback left it: its statistics are written again below.
            await self._mirror.wait_for_revision(written, MIRROR_LAG_TIMEOUT)
        view = self._mirror.group(group)
        stuck = "; ".join(f"{c.job} on {c.node}: {c.error}" for c in culprits)
        note = (
            f"{record.to_job} waits: the state of {', '.join(sorted({c.job for c in culprits}))} "
            f"could not be checkpointed ({stuck}); retried, and granted once that state is off "
            "the devices"
        )
        stats = view.stats
        stats.last_error = note
        told = False  # the note went with a fault's statistics
        for job in sorted({c.job for c in culprits}):
            entry = view.queued(job)
            if entry is None or job == record.to_job:
                continue
            mine = "; ".join(f"on {c.node}: {c.error}" for c in culprits if c.job == job)
            reason = (
                f"the state of {job} could not be checkpointed for the next job in line "
                f"({record.to_job}) {mine}; {job} is faulted, not {record.to_job}, until its "
                "state can leave the devices (fix what failed, or end its processes)"
            )
            stats.faults += 1
            faulted = await self._store.fault_waiter(group, self._auth, Fault(entry, reason), stats)
            if self._wrote(group, faulted) is None:
                stats.faults -= 1  # its entry changed meanwhile: the next retry sees it
                continue
            told = True
            log.error("group %s: %s isolated: %s", group, job, reason)
            self._metrics.switches.labels(outcome="evict_failed").inc()
        if not told:
            await self._store.note_error(group, note)
        return Next.WAIT

    async def _give_up_later(self, group: str, record: SwitchRecord, attempt: int) -> Next:
        """A checkpoint refused (host memory, a safety check) or whose failure is not known
        any more: retry the waiter with a bounded backoff, then give up on it alone."""
        key = (group, record.to_job, record.to_revision)
        if attempt < self._config.max_attempts:
            backoff = self._config.retry_backoff * 2 ** (attempt - 1)
            self.retries.put(key, Retry(attempt, time.monotonic() + backoff))
            return Next.WAIT
        self.retries.pop(key)
        view = self._mirror.group(group)
        head = view.queued(record.to_job)
        if head is None or head.revision != record.to_revision:
            return Next.AGAIN
        reason = f"switch to {record.to_job} failed {attempt} times: {view.stats.last_error}"
        stats = view.stats
        stats.last_error = reason
        stats.faults += 1
        # Isolate the head: its Acquire fails with the reason, the others keep their places.
        self._wrote(
            group, await self._store.fault_waiter(group, self._auth, Fault(head, reason), stats)
        )
        self._metrics.switches.labels(outcome="gave_up").inc()
        return Next.AGAIN

    def _forget_away(self, record: SwitchRecord, resident: ResidentRecord) -> None:
        """Mark unknown the residency of the nodes this switch went on without that are still
        away: what is on their devices is unknown (a checkpoint may or may not have run), and
        their next hello settles it. A node fenced out already had it marked so by its fence;
        one back since has had it written by its hello, which is kept."""
        agents = self._mirror.agents()
        for node in record.fenced:
            if node not in agents:
                resident.nodes.pop(node, None)

    def _note_fenced(
        self, record: SwitchRecord, results: Sequence[NodeResult], phase: str
    ) -> list[str]:
        """Add the nodes gone in this phase (fenced out, or left their groups: agent record
        expired) to the record's ``fenced`` list, and say so in last_error.

        A node that merely left is listed too: it has no fence revision to refuse this
        switch's directives with when it comes back, so only the list keeps them from it. The
        caller writes the record (with its next phase, or the commit ends it), so that
        whatever driver carries the switch on never sends them another directive of it, and
        the commit leaves their residency as the fence, or the hello that reconciles them,
        writes it.
        """
        new = [r for r in results if r.gone and r.node not in record.fenced]
        for result in new:
            record.fenced.append(result.node)
            how = "fenced out" if result.fenced else "left its groups"
            note = f"{phase}: node {result.node} {how} ({result.error})"
            log.warning("group %s: %s; going on without it", record.group, note)
            previous = self._last_error.get(record.group)
            self._last_error[record.group] = f"{previous}; {note}" if previous else note
        return [r.node for r in new]


@dataclass(frozen=True, slots=True)
class _Culprit:
    """An evicted job whose checkpoint failed on a node, and why."""

    job: str
    node: str
    error: str


def _held_back_note(job: str, nodes: list[str], wait: float) -> str:
    """What ``last_error`` says of a waiter held back for nodes that cannot restore it."""
    where = ", ".join(nodes)
    return (
        f"{job} waits: it is parked on {where}, whose agent is away or lists no worker of "
        f"{job} yet; granted once {where} has restored it, faulted after {wait:g} s"
    )


def _retrying(record: SwitchRecord, phase: str, results: Sequence[NodeResult]) -> None:
    """Say why a phase goes again: which nodes could not be reached (the retry is silent
    otherwise, and a switch that keeps retrying must be explainable from the log)."""
    unreachable = "; ".join(f"{r.node}: {r.error}" for r in results if r.unavailable)
    log.warning(
        "group %s: %s of switch %s unreachable on %s; sending again",
        record.group,
        phase,
        record.switch_id,
        unreachable,
    )


def _outcome(
    view: GroupView,
    record: SwitchRecord,
    restores: Sequence[NodeStep],
    results: Sequence[NodeResult],
    error: str = "",
) -> Stored[OperationRecord] | None:
    """The outcome of the operation ``record`` carries out, on its record's lease, for the
    transaction that ends the switch; None when the switch carries none (or its record
    expired: the switch still ends)."""
    if not record.operation:
        return None
    stored = view.operations.get(record.operation)
    if stored is None:
        return None
    op = stored.record
    moved = 0
    if not error and op.node in record.fenced:
        error = f"node {op.node} was fenced out during the operation"
    elif not error and op.kind is OperationKind.SNAPSHOT:
        moved = record.evicted_bytes
    elif not error:
        mine = [r for s, r in zip(restores, results, strict=True) if s.node == op.node]
        failed = [r for r in mine if not r.ok]
        if failed:
            error = f"restore on {op.node}: {failed[0].error}"
        moved = sum(r.bytes_moved for r in mine if r.ok)
    outcome = dataclasses.replace(
        op,
        state=OperationState.FAILED if error else OperationState.SUCCEEDED,
        finished_at=time.time(),
        bytes_moved=0 if error else moved,
        error=error,
        switch_id=record.switch_id,
    )
    return Stored(outcome, stored.create_revision, stored.mod_revision, stored.lease)
