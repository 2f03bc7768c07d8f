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
import logging
import time
from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.trace import Tracer

from timeslice_orchestrator.directives import DirectiveSender
from timeslice_orchestrator.grants import HandOvers, changed, holder_for, in_place
from timeslice_orchestrator.held_back import HeldBack
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.policy import order
from timeslice_orchestrator.reconcile import DriverConfig, Next, OwnWrites
from timeslice_orchestrator.relay import DirectiveRouter
from timeslice_orchestrator.retries import Retry, RetryLedger
from timeslice_orchestrator.store.etcd import StoreUnavailable
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import Authority, Grant, GroupStore
from timeslice_orchestrator.store.mirror import AGENTS_TOPIC, GroupView
from timeslice_orchestrator.store.records import (
    OperationKind,
    OperationRecord,
    OperationState,
    QueuedJob,
    Stored,
    hold_epoch,
)
from timeslice_orchestrator.switch_machine import SwitchMachine
from timeslice_orchestrator.switch_plan import plan, plan_operation
from timeslice_orchestrator.workqueue import KeyedBackoff, WorkQueue

log = logging.getLogger(__name__)


class SwitchDriver:
    """Drives the switches of the groups whose driver key this replica holds.

    The pass (:meth:`reconcile`) decides; the switch itself runs in :class:`SwitchMachine`,
    the rule after an aborted one in :mod:`.switch_abort`, and the waiters held back for a
    node that cannot restore them in :class:`HeldBack`.
    """

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
        tracer = tracer or trace.NoOpTracer()
        self._queue: WorkQueue[str] = WorkQueue(
            self._sync,
            workers=config.workers,
            backoff=KeyedBackoff(config.retry_backoff, config.max_backoff),
            name="driver",
            on_error=self._pass_failed,
        )
        self.retries = RetryLedger()
        """Failed switches, catch-ups and prefetches of live holds and waiters."""
        self._writes = OwnWrites(mirror)
        self.held_back = HeldBack(store, self._auth, metrics, config, self._writes)
        """Waiters held back for a node that cannot restore them."""
        directives = DirectiveSender(router, mirror, metrics, tracer, config.directive_timeout)
        self._switches = SwitchMachine(
            store, mirror, directives, self._auth, metrics, tracer, config, self.retries,
            self._writes,
        )  # fmt: skip

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
        self._writes.shown(groups)
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
        await self._writes.seen(group)
        self._writes.forget(group)
        if not self._mirror.needs_driver(group):
            self.retries.forget_group(group)
            self.held_back.ledger.forget_group(group)
            return Next.IDLE  # no switch, nobody waits (decided without decoding a record)
        if group in self._hand_overs:
            return Next.IDLE  # a yield here is granting the next waiter; kicked when it ends
        view = self._mirror.group(group)
        hold = (view.holder.record.job, hold_epoch(view.holder)) if view.holder else None
        self.retries.forget_ended(group, ((q.job, q.revision) for q in view.queue), hold)
        self.held_back.ledger.forget_ended(group, ((q.job, q.revision) for q in view.queue), None)
        if view.switch is not None:
            # Ours in flight, or left by a driver that died: carry it on from its phase.
            if not await self._drives(view):
                return Next.IDLE
            return await self._switches.advance(view.switch)
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
        servable = await self.held_back.first_servable(view, ordered, agents)
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
        return await self._switches.begin(view, head.job, head.revision, steps, attempt)

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
        note = ""
        if attempt == self._config.max_attempts:
            nodes = ", ".join(sorted({s.node for s in steps}))
            note = (
                f"holder {job} could not be restored on {nodes} after {attempt} attempts; "
                "it gets its state there at its next switch"
            )
        backoff = min(self._config.retry_backoff * 2 ** (attempt - 1), self._config.max_backoff)
        self.retries.put(key, Retry(attempt, now + backoff))
        return await self._switches.begin(view, job, epoch, steps, attempt, note=note)

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
        return await self._switches.begin(view, head.job, head.revision, steps, attempt)

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
            if self._writes.wrote(view.group, written) is not None:
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
        return await self._switches.begin(view, to_job, 0, steps, 1, operation)

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
        self._writes.wrote(view.group, epoch)
        self._metrics.grants.labels(kind="in_place").inc()
        self._metrics.acquire_wait_seconds.observe(holder.waited_seconds)
        return Next.IDLE
