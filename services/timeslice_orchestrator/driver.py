"""The switch driver: hands a group to its next waiter, moving device state when it must.

One reconcile loop per group runs on the replica that holds the group's driver key. It is
level-triggered: every pass reads the group from the mirror and takes the one step it calls
for, top to bottom:

    holder present                      -> nothing to do (lazy: no data moves on yield)
    switch record left by a dead driver -> roll it back, then go on
    queue empty                         -> nothing to do
    head's state already on its nodes   -> grant at once (no data movement)
    otherwise                           -> CHECKPOINT the residents on every node concurrently,
                                           then RESTORE the head on every node concurrently,
                                           then commit resident + holder in one transaction.

A failure before the commit rolls back (nodes that checkpointed restore their job) and retries
with bounded backoff; after that, or after a failed restore, the head alone is faulted and the
group goes on serving the others.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode, Tracer

from timeslice.backoff import Backoff
from timeslice.tracing import carrier_of
from timeslice_orchestrator.hub import AgentGone, AgentTimeout, AgentUnavailable
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.policy import Policy, order
from timeslice_orchestrator.relay import DirectiveRouter
from timeslice_orchestrator.store.cache import AGENTS_TOPIC, GroupView, Mirror, QueuedJob
from timeslice_orchestrator.store.etcd import StoreUnavailable
from timeslice_orchestrator.store.groups import Authority, Fault, Grant, GroupStore, new_switch_id
from timeslice_orchestrator.store.records import (
    AgentRecord,
    HolderRecord,
    NodeStep,
    Phase,
    Stored,
    SwitchRecord,
)
from timeslice_proto.timeslice.v1 import AckStatus, Directive, DirectiveKind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DriverConfig:
    replica_id: str
    directive_timeout: float = 30.0
    max_attempts: int = 3
    retry_backoff: float = 0.2
    max_backoff: float = 2.0
    idle_recheck: float = 2.0
    co_residency: bool = False
    prefetch: bool = False
    policy: Policy = Policy.FIFO


class Next(enum.Enum):
    """What a group's loop does after one reconcile pass."""

    IDLE = "idle"  # nothing to do until the group changes
    AGAIN = "again"  # progress was made: look again at once
    LATER = "later"  # blocked (an agent away, a lost race): retry after a backoff


@dataclass(frozen=True, slots=True)
class NodeResult:
    node: str
    ok: bool
    error: str
    bytes_moved: int
    elapsed: float
    unavailable: bool = False  # the agent could not be reached: the outcome is unknown
    gone: bool = False  # the node left its groups (agent record expired): not waited for

    @property
    def failed(self) -> bool:
        return not self.ok and not self.gone


class SwitchFailed(Exception):
    def __init__(self, phase: Phase, failures: Sequence[NodeResult]) -> None:
        self.phase = phase
        self.failures = list(failures)
        detail = "; ".join(f"{f.node}: {f.error}" for f in failures)
        super().__init__(f"{phase.value} failed on {len(failures)} node(s): {detail}")


def nodes_of(group: str, job: str, agents: dict[str, AgentRecord]) -> list[str]:
    """Nodes where ``job`` has a registered worker of ``group``."""
    return sorted(node for node, agent in agents.items() if job in agent.jobs_of(group))


def plan(
    view: GroupView,
    job: str,
    agents: dict[str, AgentRecord],
    co_residency: bool = False,
    protect: str = "",
) -> list[NodeStep] | None:
    """What must move so that ``job`` is resident on every node where it runs.

    Those are the nodes where it registered workers, plus any node an operator pinned to the
    group (static membership). On a node whose backend reports device capacity, jobs already
    there stay as long as ``job`` fits next to them (least recently restored leave first);
    elsewhere every other job leaves. A node where ``job`` is already resident needs nothing.
    """
    residency = view.residency()
    nodes = sorted(set(nodes_of(view.group, job, agents)) | set(view.static_members))
    steps: list[NodeStep] = []
    for node in nodes:
        on_device = residency.nodes.get(node, [])
        if job in on_device:
            continue
        agent = agents.get(node)
        evict = list(on_device)
        if co_residency and agent is not None and agent.capacity_bytes:
            free = agent.capacity_bytes - sum(agent.job_bytes(j) for j in on_device)
            evict = []
            for other in on_device:
                if free >= agent.job_bytes(job):
                    break
                if other == protect:
                    continue
                evict.append(other)
                free += agent.job_bytes(other)
            if free < agent.job_bytes(job):
                evict = list(on_device)
        if protect and protect in evict:
            return None
        steps += [NodeStep(node=node, evict=other, restore="") for other in evict[:-1]]
        steps.append(NodeStep(node=node, evict=evict[-1] if evict else "", restore=job))
    return steps


class SwitchDriver:
    def __init__(
        self,
        store: GroupStore,
        mirror: Mirror,
        router: DirectiveRouter,
        metrics: Metrics,
        config: DriverConfig,
        lease: int,
        tracer: Tracer | None = None,
    ) -> None:
        self._store = store
        self._mirror = mirror
        self._router = router
        self._metrics = metrics
        self._config = config
        self._auth = Authority(config.replica_id, lease)
        self._tracer = tracer or trace.NoOpTracer()
        self._kicks: dict[str, asyncio.Event] = {}
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._attempts: dict[tuple[str, str, int], int] = {}
        self._last_error: dict[str, str] = {}
        self._stopping = False

    # -- wiring -------------------------------------------------------------------------

    def start(self) -> None:
        self._mirror.add_listener(self._on_change)
        for group in self._mirror.group_names():
            self.kick(group)

    async def stop(self) -> None:
        self._stopping = True
        for task in self._loops.values():
            task.cancel()
        await asyncio.gather(*self._loops.values(), return_exceptions=True)

    def _on_change(self, topics: set[str]) -> None:
        if AGENTS_TOPIC in topics:
            for group in self._mirror.group_names():
                self.kick(group)
        for topic in topics:
            if topic.startswith("group:"):
                self.kick(topic[6:])

    def kick(self, group: str) -> None:
        if self._stopping:
            return
        event = self._kicks.setdefault(group, asyncio.Event())
        event.set()
        if group not in self._loops:
            task = asyncio.create_task(self._loop(group), name=f"driver-{group}")
            self._loops[group] = task
            task.add_done_callback(functools.partial(self._loop_done, group))

    def _loop_done(self, group: str, task: asyncio.Task[None]) -> None:
        self._loops.pop(group, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("driver loop of %s died", group, exc_info=task.exception())
            self._metrics.driver_errors.inc()
        if self._kicks.get(group) is not None and self._kicks[group].is_set():
            self.kick(group)

    async def _loop(self, group: str) -> None:
        event = self._kicks[group]
        backoff = Backoff(self._config.retry_backoff, self._config.max_backoff, jitter=False)
        while not self._stopping:
            event.clear()
            try:
                step = await self.reconcile(group)
            except StoreUnavailable as exc:
                log.warning("group %s: etcd unavailable (%s); retrying", group, exc)
                step = Next.LATER
            if step is Next.AGAIN:
                backoff.reset()
                continue
            if step is Next.LATER:
                wait = backoff.next_delay()
            else:
                wait = self._config.idle_recheck
                backoff.reset()
            try:
                async with asyncio.timeout(wait):
                    await event.wait()
            except TimeoutError:
                view = self._mirror.group(group)
                if step is Next.IDLE and not view.queue and view.switch is None:
                    return  # idle: the next change starts a fresh loop

    # -- one pass -----------------------------------------------------------------------

    async def reconcile(self, group: str) -> Next:
        """Take one step for ``group``."""
        view = self._mirror.group(group)
        if view.switch is None and view.holder is not None and view.queue:
            return await self._prefetch(view)
        if view.switch is None and (view.holder is not None or not view.queue):
            return Next.IDLE
        if view.driver is not None and view.driver_lease != self._auth.lease:
            return Next.IDLE  # another live replica drives this group
        if view.driver is None and not await self._store.claim_driver(group, self._auth):
            return Next.IDLE
        if view.switch is not None:
            # Ours in flight, or left by a driver that died: carry it on from its phase.
            return await self._advance(view.switch)
        head = order(self._config.policy, view)[0]
        agents = self._mirror.agents()
        missing = [n for n in view.static_members if n not in agents]
        if missing:
            # A pinned node must take part in every switch: wait for its agent to come back.
            log.warning("group %s: waiting for pinned node(s) %s", group, ", ".join(missing))
            return Next.LATER
        steps = plan(view, head.job, agents, self._config.co_residency)
        assert steps is not None  # nothing is protected without a holder
        if not steps:
            return await self._grant_in_place(view, head)
        attempt = self._attempts.get((group, head.job, head.revision), 0) + 1
        record = SwitchRecord(
            switch_id=new_switch_id(),
            group=group,
            to_job=head.job,
            to_revision=head.revision,
            steps=steps,
            phase=Phase.CHECKPOINT,
            driver=self._config.replica_id,
            started_at=time.time(),
            attempt=attempt,
        )
        switch = await self._store.begin_switch(group, self._auth, record, view.resident_revision)
        if switch is None:
            return Next.AGAIN  # the group changed underneath; look again
        log.info(
            "group %s: switch %s -> %s on %d node(s), epoch %d (attempt %d)",
            group,
            ",".join(record.from_jobs) or "-",
            head.job,
            len(steps),
            switch.create_revision,
            attempt,
        )
        return await self._advance(switch)

    async def _prefetch(self, view: GroupView) -> Next:
        """While the holder runs, bring the next waiter's state in if it fits beside it."""
        if not self._config.prefetch or view.holder is None:
            return Next.IDLE
        if view.driver is not None and view.driver_lease != self._auth.lease:
            return Next.IDLE
        head = order(self._config.policy, view)[0]
        steps = plan(
            view, head.job, self._mirror.agents(), co_residency=True,
            protect=view.holder.record.job,
        )  # fmt: skip
        if not steps:
            return Next.IDLE  # already resident, or it does not fit beside the holder
        if view.driver is None and not await self._store.claim_driver(view.group, self._auth):
            return Next.IDLE
        record = SwitchRecord(
            switch_id=new_switch_id(),
            group=view.group,
            to_job=head.job,
            to_revision=head.revision,
            steps=steps,
            phase=Phase.CHECKPOINT,
            driver=self._config.replica_id,
            started_at=time.time(),
            prefetch=True,
        )
        switch = await self._store.begin_switch(
            view.group, self._auth, record, view.resident_revision, view.holder.mod_revision
        )
        if switch is None:
            return Next.AGAIN
        log.info("group %s: prefetching %s beside %s", view.group, head.job, view.holder.record.job)
        return await self._advance(switch)

    async def _grant_in_place(self, view: GroupView, head: QueuedJob) -> Next:
        holder = self._holder(head, restored=False, previous="", switch_seconds=0.0)
        stats = view.stats
        stats.grants += 1
        residency = view.residency()
        for node, jobs in list(residency.nodes.items()):
            if head.job in jobs:
                residency.place(node, head.job)  # most recently used: evicted last
        epoch = await self._store.grant(
            self._auth, Grant(view.group, head, holder, residency, view.resident_revision, stats)
        )
        if epoch is None:
            return Next.AGAIN
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
        if record.phase is Phase.CHECKPOINT:
            evictions = [s for s in record.steps if s.evict]
            results = await self._fan_out(switch, DirectiveKind.CHECKPOINT, evictions, "evict")
            failed = [r for r in results if r.failed]
            next_phase = Phase.ROLLBACK if failed else Phase.RESTORE
            if failed:
                error = SwitchFailed(Phase.CHECKPOINT, failed)
                log.warning("group %s: %s; rolling back", record.group, error)
                self._metrics.switches.labels(outcome="rolled_back").inc()
                self._last_error[record.group] = str(error)
            moved = await self._store.update_switch(record.group, self._auth, switch, next_phase)
            if moved is None:
                return Next.AGAIN  # lost the driver role or raced: look again
            switch, record = moved, moved.record
        if record.phase is Phase.RESTORE:
            return await self._restore_and_commit(switch, started)
        return await self._roll_back(switch)

    async def _restore_and_commit(self, switch: Stored[SwitchRecord], started: float) -> Next:
        record = switch.record
        group = record.group
        restores = [s for s in record.steps if s.restore]
        results = await self._fan_out(switch, DirectiveKind.RESTORE, restores, "restore")
        if any(r.unavailable for r in results):
            return Next.LATER  # keep the record; the same directives go again
        view = self._mirror.group(group)
        resident = view.residency()
        for step in record.steps:
            if step.evict:
                resident.remove(step.node, step.evict)  # checkpointed to the host
        for step, result in zip(restores, results, strict=True):
            if result.ok:
                resident.place(step.node, record.to_job)
        stats = view.stats
        head = view.queued(record.to_job)
        if head is not None and head.revision != record.to_revision:
            head = None
        failed = [r for r in results if r.failed]
        if failed:
            error = SwitchFailed(Phase.RESTORE, failed)
            stats.last_error = f"{record.to_job}: {error}"
            fault = Fault(head, str(error)) if head is not None else None
            ended = await self._store.end_switch(
                group, self._auth, switch, resident, stats, fault=fault
            )
            if ended:
                self._metrics.switches.labels(outcome="restore_failed").inc()
                log.error("group %s: %s isolated: %s", group, record.to_job, error)
            return Next.AGAIN
        if record.prefetch or head is None:
            # A prefetch ends here, and so does a switch whose waiter left: keep what the
            # devices now hold, drop the record; the grant (in place) comes on its own.
            ended = await self._store.end_switch(group, self._auth, switch, resident, stats)
            if ended:
                outcome = "prefetched" if record.prefetch else "waiter_left"
                self._metrics.switches.labels(outcome=outcome).inc()
            return Next.AGAIN
        elapsed = max(time.monotonic() - started, time.time() - record.started_at)
        holder = self._holder(
            head, restored=True, previous=",".join(record.from_jobs), switch_seconds=elapsed
        )
        stats.switches += 1
        stats.grants += 1
        stats.last_switch_seconds = elapsed
        if group in self._last_error:
            stats.last_error = self._last_error.pop(group)
        epoch = await self._store.grant(
            self._auth, Grant(group, head, holder, resident, view.resident_revision, stats, switch)
        )
        if epoch is None:
            return Next.LATER  # the mirror lagged or the waiter re-attached: retry the commit
        self._attempts.pop((group, head.job, head.revision), None)
        self._metrics.switches.labels(outcome="committed").inc()
        self._metrics.switch_seconds.observe(elapsed)
        self._metrics.grants.labels(kind="switch").inc()
        self._metrics.acquire_wait_seconds.observe(holder.waited_seconds)
        log.info(
            "group %s: granted %s epoch %d after %.3f s switch", group, head.job, epoch, elapsed
        )
        return Next.IDLE

    async def _roll_back(self, switch: Stored[SwitchRecord]) -> Next:
        """Put every evicted job back where it was, then close the record."""
        record = switch.record
        group = record.group
        evictions = [s for s in record.steps if s.evict]
        results = await self._fan_out(switch, DirectiveKind.RESTORE, evictions, "rollback")
        if any(r.unavailable for r in results):
            return Next.LATER
        view = self._mirror.group(group)
        resident = view.residency()
        stats = view.stats
        stats.last_error = self._last_error.pop(group, "") or f"switch {record.switch_id} aborted"
        for step, result in zip(evictions, results, strict=True):
            if not result.ok:
                resident.remove(step.node, step.evict)
                stats.last_error += f"; rollback on {step.node} failed: {result.error}"
        if not await self._store.end_switch(group, self._auth, switch, resident, stats):
            return Next.AGAIN
        return await self._after_abort(group, record)

    async def _after_abort(self, group: str, record: SwitchRecord) -> Next:
        """Retry the waiter with a bounded backoff, then give up on it alone."""
        if record.prefetch:
            return Next.IDLE  # an optimisation that did not work out: the switch will do it
        key = (group, record.to_job, record.to_revision)
        attempt = max(self._attempts.get(key, 0), record.attempt)
        if attempt < self._config.max_attempts:
            self._attempts[key] = attempt
            await asyncio.sleep(self._config.retry_backoff * 2 ** (attempt - 1))
            return Next.AGAIN
        self._attempts.pop(key, None)
        view = self._mirror.group(group)
        head = view.queued(record.to_job)
        if head is None or head.revision != record.to_revision:
            return Next.AGAIN
        reason = f"switch to {record.to_job} failed {attempt} times: {view.stats.last_error}"
        stats = view.stats
        stats.last_error = reason
        # Isolate the head: its Acquire fails with the reason, the others keep their places.
        await self._store.fault_waiter(group, self._auth, Fault(head, reason), stats)
        self._metrics.switches.labels(outcome="gave_up").inc()
        return Next.AGAIN

    def _holder(
        self, head: QueuedJob, *, restored: bool, previous: str, switch_seconds: float
    ) -> HolderRecord:
        now = time.time()
        entry = head.entry.record
        return HolderRecord(
            job=head.job,
            session=entry.session,
            request_id=entry.request_id,
            attempt=entry.attempt,
            ticket=head.revision,
            granted_at=now,
            waited_seconds=max(0.0, now - entry.enqueued_at),
            restored=restored,
            previous_job=previous,
            switch_seconds=switch_seconds,
        )

    # -- directives ---------------------------------------------------------------------

    async def _fan_out(
        self,
        switch: Stored[SwitchRecord],
        kind: DirectiveKind,
        steps: list[NodeStep],
        purpose: str,
    ) -> list[NodeResult]:
        """Send one directive per node concurrently and gather every node's outcome."""
        with self._tracer.start_as_current_span(
            f"timeslice.{purpose}",
            attributes={"timeslice.group": switch.record.group, "timeslice.nodes": len(steps)},
        ) as span:
            results = list(
                await asyncio.gather(*(self._run_step(switch, kind, s, purpose) for s in steps))
            )
            failed = [r.node for r in results if not r.ok]
            if failed:
                span.set_status(StatusCode.ERROR, f"failed on {', '.join(failed)}")
            return results

    async def _run_step(
        self, switch: Stored[SwitchRecord], kind: DirectiveKind, step: NodeStep, purpose: str
    ) -> NodeResult:
        job = step.evict if purpose in ("evict", "rollback") else step.restore
        agent = self._mirror.agents().get(step.node)
        with self._tracer.start_as_current_span(
            f"timeslice.{purpose} {step.node}",
            kind=SpanKind.CLIENT,
            attributes={
                "timeslice.group": switch.record.group,
                "timeslice.node": step.node,
                "timeslice.job": job,
                "timeslice.epoch": switch.create_revision,
                "timeslice.directive": kind.name.lower(),
                "timeslice.backend": agent.backend if agent else "",
                "timeslice.emulated": bool(agent and agent.emulated),
            },
        ) as span:
            directive = Directive(
                directive_id=f"{switch.record.switch_id}-{purpose}-{step.node}-{job}",
                group_id=switch.record.group,
                epoch=switch.create_revision,
                kind=kind,
                job_id=job,
                deadline_ms=int(self._config.directive_timeout * 1000),
                trace_context=carrier_of(span),
            )
            result = await self._execute(step.node, directive, kind)
            span.set_attributes(
                {
                    "timeslice.bytes_moved": result.bytes_moved,
                    "timeslice.backend_seconds": result.elapsed,
                }
            )
            if not result.ok:
                span.set_status(StatusCode.ERROR, result.error)
            return result

    async def _execute(self, node: str, directive: Directive, kind: DirectiveKind) -> NodeResult:
        started = time.monotonic()
        label = kind.name.lower()
        try:
            ack = await self._router.execute(node, directive, self._config.directive_timeout + 1)
        except AgentTimeout as exc:
            # Connected but silent past the deadline: a failure, like a backend error.
            self._metrics.directives.labels(kind=label, status="timeout").inc()
            return NodeResult(node, False, str(exc), 0, time.monotonic() - started)
        except AgentGone as exc:
            # Final: the node left its groups; whatever it held is no longer counted on.
            self._metrics.directives.labels(kind=label, status="gone").inc()
            return NodeResult(node, False, str(exc), 0, time.monotonic() - started, gone=True)
        except AgentUnavailable as exc:
            self._metrics.directives.labels(kind=label, status="unavailable").inc()
            return NodeResult(node, False, str(exc), 0, time.monotonic() - started, True)
        self._metrics.directives.labels(kind=label, status=ack.status.name.lower()).inc()
        ok = ack.status == AckStatus.OK
        error = "" if ok else f"{ack.status.name.lower()}: {ack.error}"
        return NodeResult(node, ok, error, ack.bytes_moved, ack.elapsed_seconds)
