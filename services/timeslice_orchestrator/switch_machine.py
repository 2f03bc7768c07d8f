"""The state machine of one switch: its record moves through explicit phases.

::

    (begin) --> CHECKPOINT --> RESTORE --> (commit: the grant) | (end without a grant)
                    |
                    +--------> ROLLBACK --> (end) --> the abort rule (:mod:`.switch_abort`)

The driver begins a switch by writing its record (phase CHECKPOINT), after claiming the group
(:mod:`.driver`). Every phase fans one directive per node out concurrently
(:mod:`.directives`) and then writes the record's next phase, or ends it; a record found in
etcd (left by a driver that died) is carried on from the phase it names. Every directive id is
fixed by (switch, phase, node), so a phase sent again after a crash is answered from the
agents' ledgers instead of being done twice.

- An agent that cannot be reached leaves the record where it is (outcome unknown) with the
  nodes fenced meanwhile listed in it, and the pass is retried: rolling back would race it.
- A node gone (fenced out, or its agent record expired) is listed in the record, sent nothing
  more of the switch, and the switch completes on the nodes that answer.
- A failed checkpoint rolls back: the nodes that checkpointed restore their job.
- A failed restore ends the switch and faults the waiter (a prefetch's waiter keeps its place).
- A waiter parked on a node that cannot restore it is not granted (:mod:`.held_back`).

The notes of a switch (nodes gone, a failed checkpoint, a catch-up given up) are gathered per
group and written into the group's ``last_error`` with the transaction that ends the switch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

from opentelemetry.trace import Link, Tracer

from timeslice.tracing import link_to
from timeslice_orchestrator.directives import DirectiveSender, NodeResult
from timeslice_orchestrator.grants import holder_for
from timeslice_orchestrator.held_back import held_back_note
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.reconcile import DriverConfig, Next, OwnWrites
from timeslice_orchestrator.retries import RetryLedger
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import Authority, Fault, Grant, GroupStore, new_switch_id
from timeslice_orchestrator.store.mirror import GroupView
from timeslice_orchestrator.store.records import (
    NodeStep,
    OperationKind,
    OperationRecord,
    OperationState,
    ResidentRecord,
    Stored,
    SwitchKind,
    SwitchPhase,
    SwitchRecord,
)
from timeslice_orchestrator.switch_abort import AbortRule, Culprit
from timeslice_orchestrator.switch_plan import stranded
from timeslice_proto.timeslice.v1 import DirectiveKind

# The driver's logger, as every part of the driver: a group's switches read in one stream.
log = logging.getLogger("timeslice_orchestrator.driver")

# The phases a switch record may move to from each phase; None: the record is deleted, the
# switch has ended (with a grant, or without one).
_MOVES: dict[SwitchPhase, frozenset[SwitchPhase | None]] = {
    SwitchPhase.CHECKPOINT: frozenset({SwitchPhase.RESTORE, SwitchPhase.ROLLBACK}),
    SwitchPhase.RESTORE: frozenset({None}),
    SwitchPhase.ROLLBACK: frozenset({None}),
}


def can_move(src: SwitchPhase, dst: SwitchPhase | None) -> bool:
    """Whether a switch in phase ``src`` may move to ``dst`` (None: end)."""
    return dst in _MOVES[src]


class SwitchFailed(Exception):
    """A switch phase failed on some nodes."""

    def __init__(self, phase: SwitchPhase, failures: Sequence[NodeResult]) -> None:
        self.phase = phase
        self.failures = list(failures)
        detail = "; ".join(f"{f.node}: {f.error}" for f in failures)
        super().__init__(f"{phase.value} failed on {len(failures)} node(s): {detail}")


class SwitchMachine:
    """Begins switches and drives their records from phase to phase (module docstring)."""

    def __init__(
        self,
        store: GroupStore,
        mirror: Mirror,
        directives: DirectiveSender,
        auth: Authority,
        metrics: Metrics,
        tracer: Tracer,
        config: DriverConfig,
        retries: RetryLedger,
        writes: OwnWrites,
    ) -> None:
        self._store = store
        self._mirror = mirror
        self._directives = directives
        self._auth = auth
        self._metrics = metrics
        self._tracer = tracer
        self._config = config
        self._retries = retries
        self._writes = writes
        self._abort = AbortRule(store, mirror, auth, metrics, config, retries, writes)
        self._notes: dict[str, str] = {}  # per group, for last_error when the switch ends

    # -- begin ------------------------------------------------------------------------------

    async def begin(
        self,
        view: GroupView,
        to_job: str,
        to_revision: int,
        steps: list[NodeStep],
        attempt: int,
        operation: Stored[OperationRecord] | None = None,
        note: str = "",
    ) -> Next:
        """Write the switch record towards ``to_job``, then drive it.

        With the group free this is a switch (``to_revision``: the waiter's queue entry);
        beside a holder it is a prefetch of a waiter, or the catch-up of the holder itself
        (``to_revision``: its epoch), which move only what fits next to the hold and end
        without a grant. With ``operation`` it carries out that operator operation (no
        waiter: ``to_revision`` 0), beside the holder or on the free group, without a grant.
        ``note`` goes into ``last_error`` when the switch ends.
        """
        group = view.group
        if note:
            self._notes[group] = note
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
        self._writes.wrote(group, switch.mod_revision)
        _log_begun(view, switch, operation)
        return await self.advance(switch)

    # -- the phases, in order ---------------------------------------------------------------

    async def advance(self, switch: Stored[SwitchRecord]) -> Next:
        """Drive a switch record from its current phase to its end, in one traced span that
        links to the Acquire it serves (:func:`_served_acquires`)."""
        with self._tracer.start_as_current_span(
            "timeslice.switch",
            attributes=_span_attributes(switch, self._config.replica_id),
            links=_served_acquires(self._mirror, switch),
        ) as span:
            outcome = await self._advance_phases(switch)
            span.set_attribute("timeslice.next", outcome.value)
            return outcome

    async def _advance_phases(self, switch: Stored[SwitchRecord]) -> Next:
        """CHECKPOINT -> RESTORE -> commit on success; CHECKPOINT -> ROLLBACK -> end on a
        failure. An unreachable agent leaves the record in place (outcome unknown) and the
        pass is retried; a backend failure is final."""
        started = time.monotonic()
        culprits: list[Culprit] = []
        if switch.record.phase is SwitchPhase.CHECKPOINT:
            checkpointed = await self._checkpoint(switch)
            if isinstance(checkpointed, Next):
                return checkpointed
            switch, culprits = checkpointed
        if switch.record.phase is SwitchPhase.RESTORE:
            return await self._restore_and_commit(switch, started)
        # ROLLBACK: after a failed checkpoint, or carried on after a driver died (whose
        # checkpoint failed is not known any more: no culprits).
        return await self._roll_back(switch, culprits)

    async def _checkpoint(
        self, switch: Stored[SwitchRecord]
    ) -> Next | tuple[Stored[SwitchRecord], list[Culprit]]:
        """Checkpoint the evicted jobs on every node; the record moved to its next phase
        (RESTORE, or ROLLBACK with the jobs whose checkpoint failed), or what to do now."""
        record = switch.record
        evictions = [s for s in record.steps if s.evict]
        results = await self._directives.fan_out(
            switch, DirectiveKind.CHECKPOINT, evictions, "evict"
        )
        if await self._unreachable(switch, results, "checkpoint"):
            # Outcome unknown (the stream broke, the relay moved): rolling back now would race
            # the checkpoint.
            return Next.LATER
        failed = [r for r in results if r.failed]
        culprits = [
            Culprit(step.evict, step.node, r.error)
            for step, r in zip(evictions, results, strict=True)
            # A refusal (host memory, safety) is the node's capacity, not the job's fault.
            if r.failed and not r.refused
        ]
        next_phase = SwitchPhase.ROLLBACK if failed else SwitchPhase.RESTORE
        if failed:
            error = SwitchFailed(SwitchPhase.CHECKPOINT, failed)
            log.warning("group %s: %s; rolling back", record.group, error)
            self._metrics.switches.labels(outcome="rolled_back").inc()
            self._add_note(record.group, str(error))
        evicted = sum(r.bytes_moved for r in results if r.ok)
        assert can_move(record.phase, next_phase)
        moved = await self._store.update_switch(
            record.group, self._auth, switch, next_phase, evicted_bytes=evicted
        )
        if moved is None:
            return Next.AGAIN  # lost the driver role or raced: look again
        self._writes.wrote(record.group, moved.mod_revision)
        return moved, culprits

    async def _restore_and_commit(self, switch: Stored[SwitchRecord], started: float) -> Next:
        """Restore the waiter on every node, then grant it (commit) or end without a grant."""
        record = switch.record
        group = record.group
        assert can_move(record.phase, None)
        # Nodes gone before this phase: whether their checkpoint ran is not known.
        gone_in_checkpoint = set(record.fenced)
        restores = [s for s in record.steps if s.restore]
        results = await self._directives.fan_out(switch, DirectiveKind.RESTORE, restores, "restore")
        if await self._unreachable(switch, results, "restore"):
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
        if head is not None and record.kind is SwitchKind.HANDOVER:
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
            fault = (
                Fault(head, str(error))
                if head is not None and record.kind is SwitchKind.HANDOVER
                else None
            )
            stats.faults += fault is not None
            ended = self._writes.wrote(
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
                if record.kind is SwitchKind.PREFETCH and head is not None:
                    log.warning("group %s: prefetch of %s failed: %s", group, record.to_job, error)
                elif head is not None:
                    log.error("group %s: %s isolated: %s", group, record.to_job, error)
                else:
                    log.warning("group %s: restore of %s failed: %s", group, record.to_job, error)
            return Next.AGAIN
        if record.kind is not SwitchKind.HANDOVER or head is None or held:
            # A prefetch ends here, and so does a switch whose waiter left, a catch-up and
            # an operator operation (no waiter): keep what the devices now hold, drop the
            # record (closing the operation with it); a grant (in place) comes on its own.
            if held:
                stats.last_error = held_back_note(record.to_job, held, self._config.held_back_for)
                if group in self._notes:
                    stats.last_error = f"{self._notes.pop(group)}; {stats.last_error}"
                log.warning(
                    "group %s: switch %s ends without a grant: %s",
                    group,
                    record.switch_id,
                    stats.last_error,
                )
            ended = self._writes.wrote(
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
                if record.kind is SwitchKind.OPERATION:
                    outcome = "operation"
                elif held:
                    outcome = "held_back"
                elif record.kind is SwitchKind.PREFETCH:
                    outcome = "prefetched"
                else:
                    outcome = "waiter_left"
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
        if group in self._notes:
            stats.last_error = self._notes.pop(group)
        committing = time.monotonic()
        epoch = await self._store.grant(
            self._auth, Grant(group, head, holder, resident, view.resident_revision, stats, switch)
        )
        self._metrics.switch_phase_seconds.labels(phase="commit").observe(
            time.monotonic() - committing
        )
        self._writes.wrote(group, epoch)
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
        self._retries.pop((group, head.job, head.revision))
        self._metrics.switches.labels(outcome="committed").inc()
        self._metrics.switch_seconds.observe(elapsed)
        self._metrics.grants.labels(kind="switch").inc()
        self._metrics.acquire_wait_seconds.observe(holder.waited_seconds)
        log.info(
            "group %s: granted %s epoch %d after %.3f s switch", group, head.job, epoch, elapsed
        )
        return Next.IDLE

    async def _roll_back(self, switch: Stored[SwitchRecord], culprits: list[Culprit]) -> Next:
        """Put every evicted job back where it was, close the record, then apply the abort
        rule. ``culprits``: the evicted jobs whose checkpoint failed (empty when not known)."""
        record = switch.record
        group = record.group
        assert can_move(record.phase, None)
        evictions = [s for s in record.steps if s.evict]
        results = await self._directives.fan_out(
            switch, DirectiveKind.RESTORE, evictions, "rollback"
        )
        if await self._unreachable(switch, results, "rollback"):
            return Next.LATER
        view = self._mirror.group(group)
        resident = view.residency()
        self._forget_away(record, resident)
        stats = view.stats
        stats.last_error = self._notes.pop(group, "") or f"switch {record.switch_id} aborted"
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
        if not self._writes.wrote(group, ended):
            return Next.AGAIN
        return await self._abort.after_abort(group, record, culprits)

    # -- what every phase shares -------------------------------------------------------------

    async def _unreachable(
        self, switch: Stored[SwitchRecord], results: Sequence[NodeResult], phase: str
    ) -> bool:
        """Note the nodes gone in this phase; then, if some node could not be reached, keep
        the record where it is (with those nodes fenced) for the same directives to go again:
        the agents answer what they already did. True: the phase goes again (Next.LATER)."""
        record = switch.record
        fenced = self._note_fenced(record, results, phase)
        if not any(r.unavailable for r in results):
            return False
        if fenced:
            kept = await self._store.update_switch(record.group, self._auth, switch, record.phase)
            self._writes.wrote(record.group, kept.mod_revision if kept else None)
        _retrying(record, phase, results)
        return True

    def _add_note(self, group: str, note: str) -> None:
        previous = self._notes.get(group)
        self._notes[group] = f"{previous}; {note}" if previous else note

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
            self._add_note(record.group, note)
        return [r.node for r in new]

    def _forget_away(self, record: SwitchRecord, resident: ResidentRecord) -> None:
        """Mark unknown the residency of the nodes this switch went on without that are still
        away: what is on their devices is unknown (a checkpoint may or may not have run), and
        their next hello settles it. A node fenced out already had it marked so by its fence;
        one back since has had it written by its hello, which is kept."""
        agents = self._mirror.agents()
        for node in record.fenced:
            if node not in agents:
                resident.nodes.pop(node, None)


def _log_begun(
    view: GroupView, switch: Stored[SwitchRecord], operation: Stored[OperationRecord] | None
) -> None:
    """Say what a switch just written is for: an operation, a catch-up, a prefetch, or a
    switch towards a waiter."""
    group, record = view.group, switch.record
    to_job, steps = record.to_job, record.steps
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
            record.attempt,
        )


def _served_acquires(mirror: Mirror, switch: Stored[SwitchRecord]) -> list[Link]:
    """Links to the Acquire calls ``switch`` serves: its waiter's, while it still waits (the
    queue entry keeps that call's span). A link, not a parent: a switch is the group's work,
    begun by whichever replica drives it; the job's trace reaches it through the link."""
    record = switch.record
    if not record.to_revision:
        return []  # an operator operation: no waiter
    queued = mirror.group(record.group).queued(record.to_job)
    if queued is None or queued.revision != record.to_revision:
        return []  # granted meanwhile (a carried-over switch), or a later entry
    link = link_to(queued.entry.record.trace_context)
    return [] if link is None else [link]


def _span_attributes(switch: Stored[SwitchRecord], replica_id: str) -> dict[str, str | int]:
    """The attributes of a switch's ``timeslice.switch`` span (docs/deployment.md)."""
    record = switch.record
    return {
        "timeslice.group": record.group,
        "timeslice.switch_id": record.switch_id,
        "timeslice.switch_kind": record.kind.value,
        "timeslice.epoch": switch.create_revision,
        "timeslice.from_jobs": ",".join(record.from_jobs),
        "timeslice.to_job": record.to_job,
        "timeslice.nodes": len(record.steps),
        "timeslice.attempt": record.attempt,
        "timeslice.resumed_phase": record.phase.value,
        "timeslice.driver": replica_id,
    }


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
