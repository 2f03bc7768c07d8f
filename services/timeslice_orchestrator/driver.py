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
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from timeslice_orchestrator.hub import AgentUnavailable
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.relay import DirectiveRouter
from timeslice_orchestrator.store.cache import AGENTS_TOPIC, GroupView, Mirror, QueuedJob
from timeslice_orchestrator.store.etcd import StoreUnavailable
from timeslice_orchestrator.store.groups import Authority, GroupStore, new_switch_id
from timeslice_orchestrator.store.records import (
    AgentRecord,
    GroupStats,
    HolderRecord,
    NodeStep,
    Phase,
    ResidentRecord,
    Stored,
    SwitchRecord,
)
from timeslice_proto.timeslice.v1 import AckStatus, Directive, DirectiveAck, DirectiveKind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DriverConfig:
    replica_id: str
    directive_timeout: float = 30.0
    max_attempts: int = 3
    retry_backoff: float = 0.2
    idle_recheck: float = 2.0


@dataclass(frozen=True, slots=True)
class NodeResult:
    node: str
    ok: bool
    error: str
    bytes_moved: int
    elapsed: float


class SwitchFailed(Exception):
    def __init__(self, phase: Phase, failures: Sequence[NodeResult]) -> None:
        self.phase = phase
        self.failures = list(failures)
        detail = "; ".join(f"{f.node}: {f.error}" for f in failures)
        super().__init__(f"{phase.value} failed on {len(failures)} node(s): {detail}")


def nodes_of(group: str, job: str, agents: dict[str, AgentRecord]) -> list[str]:
    """Nodes where ``job`` has a registered worker of ``group``."""
    return sorted(node for node, agent in agents.items() if job in agent.jobs_of(group))


def plan(view: GroupView, job: str, agents: dict[str, AgentRecord]) -> list[NodeStep]:
    """What must move so that ``job`` is resident on every node where it runs."""
    resident = view.resident_nodes
    return [
        NodeStep(node=node, evict=resident.get(node, ""), restore=job)
        for node in nodes_of(view.group, job, agents)
        if resident.get(node, "") != job
    ]


class SwitchDriver:
    def __init__(
        self,
        store: GroupStore,
        mirror: Mirror,
        router: DirectiveRouter,
        metrics: Metrics,
        config: DriverConfig,
        lease: int,
    ) -> None:
        self._store = store
        self._mirror = mirror
        self._router = router
        self._metrics = metrics
        self._config = config
        self._auth = Authority(config.replica_id, lease)
        self._kicks: dict[str, asyncio.Event] = {}
        self._loops: dict[str, asyncio.Task[None]] = {}
        self._attempts: dict[tuple[str, str, int], int] = {}
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
        backoff = self._config.retry_backoff
        while not self._stopping:
            event.clear()
            try:
                busy = await self.reconcile(group)
                backoff = self._config.retry_backoff
            except StoreUnavailable as exc:
                log.warning("group %s: etcd unavailable (%s); retrying", group, exc)
                busy = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            if busy:
                continue
            try:
                async with asyncio.timeout(self._config.idle_recheck):
                    await event.wait()
            except TimeoutError:
                if not self._mirror.group(group).queue:
                    return  # idle: the next change starts a fresh loop

    # -- one pass -----------------------------------------------------------------------

    async def reconcile(self, group: str) -> bool:
        """Take one step for ``group``; True when another pass should follow at once."""
        view = self._mirror.group(group)
        if view.holder is not None or (not view.queue and view.switch is None):
            return False
        if view.driver is not None and view.driver_lease != self._auth.lease:
            return False  # another live replica drives this group
        if view.driver is None and not await self._store.claim_driver(group, self._auth):
            return False
        if view.switch is not None:
            await self._recover(view, view.switch)
            return True
        head = view.queue[0]
        steps = plan(view, head.job, self._mirror.agents())
        if not steps:
            return await self._grant_in_place(view, head)
        return await self._switch(view, head, steps)

    async def _grant_in_place(self, view: GroupView, head: QueuedJob) -> bool:
        now = time.time()
        holder = HolderRecord(
            job=head.job,
            session=head.entry.record.session,
            request_id=head.entry.record.request_id,
            granted_at=now,
            waited_seconds=max(0.0, now - head.entry.record.enqueued_at),
        )
        stats = view.stats
        stats.grants += 1
        resident = ResidentRecord(view.resident_nodes)
        epoch = await self._store.grant(
            view.group,
            self._auth,
            head.entry,
            head.job,
            holder,
            resident,
            view.resident.mod_revision if view.resident else 0,
            None,
            stats,
        )
        if epoch is not None:
            self._metrics.grants.labels(kind="in_place").inc()
            self._metrics.acquire_wait_seconds.observe(holder.waited_seconds)
        return epoch is None

    async def _switch(self, view: GroupView, head: QueuedJob, steps: list[NodeStep]) -> bool:
        group = view.group
        key = (group, head.job, head.revision)
        attempt = self._attempts.get(key, 0) + 1
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
        resident_rev = view.resident.mod_revision if view.resident else 0
        switch = await self._store.begin_switch(group, self._auth, record, resident_rev)
        if switch is None:
            return True  # the group changed underneath; look again
        started = time.monotonic()
        resident = view.resident_nodes
        stats = view.stats
        log.info(
            "group %s: switch %s -> %s on %d node(s), epoch %d (attempt %d)",
            group,
            ",".join(record.from_jobs) or "-",
            head.job,
            len(steps),
            switch.create_revision,
            attempt,
        )

        # Phase 1: CHECKPOINT whatever occupies the head's nodes, everywhere at once.
        evictions = [s for s in steps if s.evict]
        checkpointed = await self._fan_out(switch, DirectiveKind.CHECKPOINT, evictions)
        failed = [r for r in checkpointed if not r.ok]
        if failed:
            done = [s for s, r in zip(evictions, checkpointed, strict=True) if r.ok]
            await self._roll_back(
                switch, done, stats, resident, SwitchFailed(Phase.CHECKPOINT, failed)
            )
            return await self._after_failure(view, head, key, attempt)
        for step in evictions:
            resident.pop(step.node, None)

        # Phase 2: RESTORE the head on all its nodes at once.
        moved = await self._store.update_switch(group, self._auth, switch, Phase.RESTORE)
        if moved is None:
            return True  # lost the driver role; the new driver recovers from the record
        switch = moved
        restored = await self._fan_out(switch, DirectiveKind.RESTORE, steps)
        failed = [r for r in restored if not r.ok]
        for step, result in zip(steps, restored, strict=True):
            if result.ok:
                resident[step.node] = head.job
        if failed:
            error = SwitchFailed(Phase.RESTORE, failed)
            stats.last_error = f"{head.job}: {error}"
            await self._store.end_switch(
                group,
                self._auth,
                switch,
                ResidentRecord(resident),
                stats,
                fault=(head.job, head.entry, str(error)),
            )
            self._metrics.switches.labels(outcome="restore_failed").inc()
            log.error("group %s: %s isolated: %s", group, head.job, error)
            self._attempts.pop(key, None)
            return True

        # Commit: resident, holder with a new epoch, queue entry and switch record, one txn.
        elapsed = time.monotonic() - started
        now = time.time()
        holder = HolderRecord(
            job=head.job,
            session=head.entry.record.session,
            request_id=head.entry.record.request_id,
            granted_at=now,
            waited_seconds=max(0.0, now - head.entry.record.enqueued_at),
            restored=True,
            previous_job=",".join(record.from_jobs),
            switch_seconds=elapsed,
        )
        stats.switches += 1
        stats.grants += 1
        stats.last_switch_seconds = elapsed
        epoch = await self._store.grant(
            group,
            self._auth,
            head.entry,
            head.job,
            holder,
            ResidentRecord(resident),
            resident_rev,
            switch,
            stats,
        )
        self._attempts.pop(key, None)
        if epoch is None:
            # The waiter left mid-switch: keep what the devices now hold, drop the record.
            stats.grants -= 1
            await self._store.end_switch(group, self._auth, switch, ResidentRecord(resident), stats)
            self._metrics.switches.labels(outcome="waiter_left").inc()
            return True
        self._metrics.switches.labels(outcome="committed").inc()
        self._metrics.switch_seconds.observe(elapsed)
        self._metrics.grants.labels(kind="switch").inc()
        self._metrics.acquire_wait_seconds.observe(holder.waited_seconds)
        log.info(
            "group %s: granted %s epoch %d after %.3f s switch", group, head.job, epoch, elapsed
        )
        return False

    async def _after_failure(
        self, view: GroupView, head: QueuedJob, key: tuple[str, str, int], attempt: int
    ) -> bool:
        if attempt < self._config.max_attempts:
            self._attempts[key] = attempt
            await asyncio.sleep(self._config.retry_backoff * 2 ** (attempt - 1))
            return True
        self._attempts.pop(key, None)
        fresh = self._mirror.group(view.group)
        reason = f"switch to {head.job} failed {attempt} times: {fresh.stats.last_error}"
        # Isolate the head: its Acquire fails with the reason, the others keep their places.
        stats = fresh.stats
        stats.last_error = reason
        await self._store.fault_waiter(view.group, self._auth, head.job, head.entry, reason, stats)
        self._metrics.switches.labels(outcome="gave_up").inc()
        return True

    async def _roll_back(
        self,
        switch: Stored[SwitchRecord],
        checkpointed: list[NodeStep],
        stats: GroupStats,
        resident: dict[str, str],
        error: SwitchFailed,
    ) -> None:
        group = switch.record.group
        log.warning("group %s: %s; rolling back %d node(s)", group, error, len(checkpointed))
        stats.last_error = str(error)
        self._metrics.switches.labels(outcome="rolled_back").inc()
        moved = await self._store.update_switch(group, self._auth, switch, Phase.ROLLBACK)
        if moved is None:
            return
        back = [NodeStep(s.node, evict="", restore=s.evict) for s in checkpointed]
        results = await self._fan_out(moved, DirectiveKind.RESTORE, back)
        for step, result in zip(back, results, strict=True):
            if not result.ok:
                resident.pop(step.node, None)
                stats.last_error += f"; rollback on {step.node} failed: {result.error}"
        await self._store.end_switch(group, self._auth, moved, ResidentRecord(resident), stats)

    async def _recover(self, view: GroupView, switch: Stored[SwitchRecord]) -> None:
        """Abort a switch whose driver died: put back every evicted job, clear the record."""
        log.warning(
            "group %s: recovering switch %s left in phase %s by %s",
            view.group,
            switch.record.switch_id,
            switch.record.phase.value,
            switch.record.driver,
        )
        resident = view.resident_nodes
        evicted = [s for s in switch.record.steps if s.evict]
        failed = SwitchFailed(switch.record.phase, [NodeResult("-", False, "driver lost", 0, 0.0)])
        await self._roll_back(switch, evicted, view.stats, resident, failed)

    async def _fan_out(
        self, switch: Stored[SwitchRecord], kind: DirectiveKind, steps: list[NodeStep]
    ) -> list[NodeResult]:
        """Send one directive per node concurrently and gather every node's outcome."""
        group = switch.record.group
        return list(await asyncio.gather(*(self._run_step(group, switch, kind, s) for s in steps)))

    async def _run_step(
        self, group: str, switch: Stored[SwitchRecord], kind: DirectiveKind, step: NodeStep
    ) -> NodeResult:
        job = step.evict if kind is DirectiveKind.CHECKPOINT else step.restore
        directive = Directive(
            directive_id=f"{switch.record.switch_id}-{switch.record.phase.value}-{step.node}",
            group_id=group,
            epoch=switch.create_revision,
            kind=kind,
            job_id=job,
            deadline_ms=int(self._config.directive_timeout * 1000),
        )
        started = time.monotonic()
        try:
            ack = await self._router.execute(
                step.node, directive, self._config.directive_timeout + 1
            )
        except AgentUnavailable as exc:
            self._metrics.directives.labels(kind=kind.name.lower(), status="unavailable").inc()
            return NodeResult(step.node, False, str(exc), 0, time.monotonic() - started)
        self._metrics.directives.labels(
            kind=kind.name.lower(), status=ack.status.name.lower()
        ).inc()
        return _result(step.node, ack)


def _result(node: str, ack: DirectiveAck) -> NodeResult:
    ok = ack.status == AckStatus.OK
    error = "" if ok else f"{ack.status.name.lower()}: {ack.error}"
    return NodeResult(node, ok, error, ack.bytes_moved, ack.elapsed_seconds)
