"""Directive execution: the ack pipeline, with fencing, idempotency and per-job serialisation.

Every directive received gets exactly one ack:

1. A directive id seen before is answered with its stored ack, never executed twice
   (:class:`~timeslice_agent.ledger.AckLedger`). A duplicate of a directive still running
   gets the same ack once it is durable.
2. A malformed directive is REFUSED and changes nothing.
3. Fencing (:mod:`timeslice_agent.fencing`): the highest epoch accepted per group is
   remembered (and persisted before anything is acted on). A directive older than that is
   acked STALE_EPOCH (cause GROUP_EPOCH). Equal epochs are accepted: the checkpoint and restore
   of one switch share one. The check runs when the directive arrives and again when it gets
   its job's lock, so a directive that waited behind another can never act after a newer
   authority was accepted for its group. A node that was fenced out learns the fence revision
   in its next Welcome (:meth:`DirectiveExecutor.adopt_fence`): every directive with a lower
   epoch, of any group, is then STALE_EPOCH (cause NODE_FENCED) as well.
4. Directives for different jobs run concurrently, each in its own supervised task; directives
   for one job are serialised by a per-job FIFO lock, and run as a procedure
   (:mod:`timeslice_agent.procedures`) against the job table (:mod:`timeslice_agent.jobtable`).
5. ``deadline_ms`` bounds the whole directive (lock wait, hooks, backend); on overrun the work
   is cancelled and the ack is FAILED "deadline exceeded after X s".
6. A directive that arrives while the link says the agent's own event loop was stalled (a
   pause long enough that the orchestrator may have fenced the node) is REFUSED, and not
   remembered: it was most likely waiting in a socket buffer during the pause
   (``docs/fencing.md``).
7. A job is in one group on a node at a time (:meth:`JobTable.check_registration`); a
   directive of a group the job left here finds nothing to move and is acked OK.
8. A directive that moved a job's state is acked OK only once the job's new state is in the
   state file. When the state file cannot be written, before acting or after, the directive is
   not answered and the node stops answering directives at all until a write succeeds
   (:mod:`timeslice_agent.durability`). An ack remembered but not written is written then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode, Tracer

from timeslice.errors import InvalidArgument
from timeslice.ids import validate_group_id, validate_job_id
from timeslice.tracing import context_from
from timeslice_agent.backends.base import Backend
from timeslice_agent.devmem import MemoryCheck
from timeslice_agent.durability import Durability
from timeslice_agent.fencing import Fencing
from timeslice_agent.hostmem import HostMemory
from timeslice_agent.jobs import Job, JobState
from timeslice_agent.jobtable import JobTable
from timeslice_agent.journal import DirectiveJournal
from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.outbox import AckOutbox
from timeslice_agent.procedures import (
    OK_NOTHING,
    UNANSWERED,
    Checkpoint,
    Clock,
    MoveParts,
    Outcome,
    Restore,
)
from timeslice_agent.statefile import AgentState, StateStore
from timeslice_agent.tasks import KeyedLocks, LockWaitExpired, Supervisor
from timeslice_agent.workers import WorkerRegistry
from timeslice_proto.timeslice.v1 import (
    AckStatus,
    Directive,
    DirectiveAck,
    DirectiveKind,
    GroupEpoch,
    JobReport,
    WorkerInfo,
)
from timeslice_proto.timeslice.v1 import JobState as ProtoJobState

log = logging.getLogger(__name__)

MAX_DIRECTIVE_ID_LENGTH = 256


@dataclass(frozen=True)
class ExecutorSettings:
    """The executor's own settings (its collaborators are passed beside them)."""

    node: str
    state_file: Path
    hook_timeout: float  # seconds each app hook may take
    # Host memory a checkpoint must fit in; None: not checked.
    host_memory: HostMemory | None = None


class DirectiveExecutor:
    """Executes directives against a backend and answers each with one ack.

    ``send_ack`` hands an ack to the orchestrator link; it must not block. ``rescan`` runs the
    process discovery before a checkpoint (None: no discovery).
    """

    def __init__(
        self,
        settings: ExecutorSettings,
        *,
        backend: Backend,
        registry: WorkerRegistry,
        metrics: AgentMetrics,
        supervisor: Supervisor,
        send_ack: Callable[[DirectiveAck], None],
        journal: DirectiveJournal | None = None,
        tracer: Tracer | None = None,
        memory_check: MemoryCheck | None = None,
        rescan: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._node = settings.node
        self._backend = backend
        self._registry = registry
        self._metrics = metrics
        self._supervisor = supervisor
        self._tracer = tracer or trace.NoOpTracer()
        # Why directives must not run now (the link's stall detector), or None.
        self.stalled: Callable[[], str | None] = lambda: None
        self._locks = KeyedLocks()  # one per job: its directives run one at a time, in order
        self._closing = False
        self.fencing = Fencing()
        self.table = JobTable(registry, self._locks, metrics, self._changed)
        self.durability = Durability(settings.state_file, self.snapshot, metrics, supervisor)
        self.outbox = AckOutbox(
            settings.node, self.durability, supervisor, metrics, send_ack, journal
        )
        self.parts = MoveParts(
            backend=backend,
            registry=registry,
            metrics=metrics,
            table=self.table,
            durability=self.durability,
            hook_timeout=settings.hook_timeout,
            host_memory=settings.host_memory,
            rescan=rescan,
        )
        # Only for backends that free device memory (the agent sets it once NVML is up).
        self.memory_check = memory_check if backend.frees_device_memory else None
        self._procedures = {
            DirectiveKind.CHECKPOINT: Checkpoint(self.parts),
            DirectiveKind.RESTORE: Restore(self.parts),
        }

    # ----- state, reports, persistence -------------------------------------------------------

    @property
    def jobs(self) -> dict[str, Job]:
        """The job table (read-only by convention; the executor owns it)."""
        return self.table.jobs

    @property
    def epochs(self) -> dict[str, int]:
        """Highest accepted epoch per group."""
        return self.fencing.epochs

    @property
    def memory_check(self) -> MemoryCheck | None:
        """NVML's device-memory checks; None without NVML (the checks are then the backend's
        word, and the log said so at start) or for a backend that frees no device memory."""
        return self.parts.memory_check

    @memory_check.setter
    def memory_check(self, check: MemoryCheck | None) -> None:
        self.parts.memory_check = check

    @property
    def store(self) -> StateStore:
        return self.durability.store

    @property
    def unwritable(self) -> str | None:
        """Why the state file cannot be written, or None while it can."""
        return self.durability.unwritable

    def snapshot(self) -> AgentState:
        """The durable part of the executor's state."""
        return AgentState(
            node=self._node,
            epochs=self.fencing.epochs,
            jobs=self.table.copies(),
            acks=self.outbox.ledger.acks(),
            fence_revision=self.fencing.revision,
        )

    def reports(self) -> list[JobReport]:
        return self.table.reports()

    @property
    def fence_revision(self) -> int:
        """The highest fence revision adopted: no directive with a lower epoch acts."""
        return self.fencing.revision

    def adopt_fence(self, revision: int) -> None:
        """The orchestrator fenced this node out at ``revision``: refuse everything older."""
        if self.fencing.adopt(revision):
            self._changed()

    async def settle(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for running directives, so a hello reports the truth."""
        running = self._supervisor.running("directive")
        if running:
            log.info("waiting up to %g s for %d running directive(s)", timeout, len(running))
            await asyncio.wait(running, timeout=timeout)

    def epoch_list(self) -> list[GroupEpoch]:
        return self.fencing.epoch_list()

    async def adopt(self, state: AgentState | None) -> None:
        """Take over the state a previous run left (before any stream or worker is served)."""
        jobs = self.table.jobs
        if state is not None:
            self.fencing.load(state.epochs, state.fence_revision)
            jobs = state.jobs
            self.outbox.ledger.load(state.acks)
        await self.table.adopt(jobs, self._backend)

    async def persist(self) -> bool:
        """Write the state file; a failure is logged and counted, never raised."""
        return await self.durability.persist()

    def _changed(self) -> None:
        self.table.count()
        self._supervisor.spawn(self.persist(), name="persist", kind="persist")

    # ----- worker registrations ----------------------------------------------------------------

    def check_registration(self, info: WorkerInfo) -> None:
        """Refuse a worker whose job is still bound to another group on this node
        (:meth:`JobTable.check_registration`)."""
        self.table.check_registration(info)

    def on_workers_changed(self, job_id: str) -> None:
        """Keep the job table in step with registrations of ``job_id``."""
        self.table.on_workers_changed(job_id)

    # ----- directives --------------------------------------------------------------------------

    def handle(self, directive: Directive) -> None:
        """Accept one directive from the stream (never blocks; work runs in its own task)."""
        loop = asyncio.get_running_loop()
        did = directive.directive_id
        if self.durability.unwritable:
            # Not answered, not remembered: nothing may act that cannot be made durable, and
            # an ack (even a stored one, perhaps not yet written) would be read as this node's
            # word while the orchestrator is fencing it out for the disk. Sent again, if at
            # all, on the stream of the next hello, once the state file can be written.
            log.warning("directive %s not answered: the state file cannot be written", did)
            self._metrics.refused.labels("unwritable").inc()
            return
        # In flight first: its ack may be remembered already but not yet durable.
        running = self.outbox.ledger.running(did)
        if running is not None:
            log.info("directive %s is already running: its ack will be sent again", did)
            self._supervisor.spawn(
                self.outbox.resend_when_done(running), name=f"duplicate:{did}", kind="duplicate"
            )
            return
        stored = self.outbox.ledger.answered(did)
        if stored is not None:
            log.info("directive %s seen before: re-sending its ack without executing", did)
            self.outbox.send(stored)
            return
        t0 = loop.time()
        deadline = t0 + directive.deadline_ms / 1000 if directive.deadline_ms else None
        clock = Clock(t0=t0, started_at=time.time(), deadline=deadline)
        if self._closing:
            # Not remembered: after a restart the same directive may well be executed.
            self.outbox.send(
                self._ack(directive, clock, Outcome(AckStatus.REFUSED, "agent is shutting down"))
            )
            return
        stalled = self.stalled()
        if stalled is not None:
            # Refused without an ack, and not remembered. The stream it came on is being
            # dropped for the stall; an ack would be queued for the next stream, where it would
            # answer the orchestrator's re-send of the same directive (acks are matched by
            # directive id) while that re-send runs: the driver would roll back a checkpoint
            # still in progress (seen in the soak). Unanswered, it is sent again on the next
            # stream, once the Welcome has said whether this node was fenced, and runs there.
            log.warning("directive %s refused: %s (not answered: its stream ends)", did, stalled)
            self._metrics.refused.labels("stalled").inc()
            return
        problem = self._invalid(directive)
        if problem is not None:
            log.warning("directive %r refused: %s", did, problem)
            self._metrics.refused.labels("invalid").inc()
            ack = self._ack(
                directive, clock, Outcome(AckStatus.REFUSED, f"invalid directive: {problem}")
            )
            self.outbox.exit(directive, ack)
            return
        stale = self._fence(directive)
        if stale is not None:
            self.outbox.exit(directive, self._ack(directive, clock, stale))
            return
        self.fencing.accept(directive.group_id, directive.epoch)
        self.outbox.ledger.start(did)
        self._supervisor.spawn(
            self._run(directive, clock), name=f"directive:{did}", kind="directive"
        )

    def _invalid(self, d: Directive) -> str | None:
        if not d.directive_id:
            return "directive_id is empty"
        if len(d.directive_id) > MAX_DIRECTIVE_ID_LENGTH:
            return f"directive_id is longer than {MAX_DIRECTIVE_ID_LENGTH} characters"
        try:
            validate_job_id(d.job_id)
            validate_group_id(d.group_id)
        except InvalidArgument as exc:
            return exc.message
        if d.kind not in (DirectiveKind.CHECKPOINT, DirectiveKind.RESTORE):
            return f"unknown directive kind {int(d.kind)}"
        elsewhere = self.table.elsewhere(d.job_id, d.group_id)
        if elsewhere is not None and not self.table.left(d.job_id, d.group_id):
            # Not a group the job left here: the orchestrator and this node disagree.
            return f"job {d.job_id} is in group {elsewhere} on this node, not {d.group_id}"
        return None

    def _fence(self, d: Directive) -> Outcome | None:
        stale = self.fencing.stale(d.group_id, d.epoch)
        if stale is None:
            return None
        self._metrics.refused.labels("stale_epoch").inc()
        log.warning("directive %s refused: %s", d.directive_id, stale.reason)
        return Outcome(AckStatus.STALE_EPOCH, stale.reason, stale_cause=stale.cause)

    def _ack(self, d: Directive, clock: Clock, outcome: Outcome) -> DirectiveAck:
        job = self.table.get(d.job_id)
        return DirectiveAck(
            directive_id=d.directive_id,
            group_id=d.group_id,
            epoch=d.epoch,
            status=outcome.status,
            error=outcome.error,
            bytes_moved=outcome.bytes_moved,
            bytes_skipped=outcome.bytes_skipped,
            moved=outcome.moved,
            stale_cause=outcome.stale_cause,
            elapsed_seconds=clock.elapsed(),
            job_state=(
                job.state.to_proto()
                if job is not None and job.group_id == d.group_id
                else ProtoJobState.UNSPECIFIED
            ),
            emulated=self._backend.emulated,
            started_at=clock.started_at,
            finished_at=time.time(),
        )

    async def _run(self, d: Directive, clock: Clock) -> None:
        # A child of the orchestrator's span for this node, through the directive's context.
        with self._tracer.start_as_current_span(
            f"timeslice.agent.{d.kind.name.lower()}",
            context=context_from(d.trace_context),
            kind=SpanKind.SERVER,
            attributes={
                "timeslice.node": self._node,
                "timeslice.group": d.group_id,
                "timeslice.job": d.job_id,
                "timeslice.epoch": d.epoch,
                "timeslice.directive_id": d.directive_id,
                "timeslice.backend": self._backend.name,
                "timeslice.emulated": self._backend.emulated,
            },
        ) as span:
            ack = await self._run_untraced(d, clock)
            span.set_attributes(
                {
                    "timeslice.status": ack.status.name.lower(),
                    "timeslice.bytes_moved": ack.bytes_moved,
                    "timeslice.bytes_skipped": ack.bytes_skipped,
                    "timeslice.backend_seconds": ack.elapsed_seconds,
                }
            )
            if ack.status is not AckStatus.OK:
                span.set_status(StatusCode.ERROR, ack.error)

    async def _run_untraced(self, d: Directive, clock: Clock) -> DirectiveAck:
        try:
            outcome = await self._execute(d, clock)
            if outcome is UNANSWERED:
                return self._unanswered(d, clock)
        except asyncio.CancelledError:
            reason = "interrupted: the agent stopped during the directive"
            job = self.table.get(d.job_id)
            if job is not None and job.state is JobState.TRANSITIONING:
                job.fault(reason)
            ack = self._ack(d, clock, Outcome(AckStatus.FAILED, reason))
            self.outbox.interrupted(d, ack)
            raise
        except Exception as exc:
            # A bug, not a backend failure: keep the agent alive and make it visible.
            log.exception("directive %s: internal error", d.directive_id)
            reason = f"internal error: {exc!r}"
            job = self.table.get(d.job_id)
            if job is not None and job.state is JobState.TRANSITIONING:
                job.fault(reason)
            outcome = Outcome(AckStatus.FAILED, reason)
        ack = self._ack(d, clock, outcome)
        if outcome.moved and ack.status is AckStatus.OK:
            if not await self.outbox.durable(ack):
                self.outbox.abandon(d.directive_id)
                log.warning(
                    "directive %s %s job %s: done, but not answered: its outcome cannot be "
                    "written to the state file (the node is fenced out until it can)",
                    d.directive_id,
                    d.kind.name.lower(),
                    d.job_id,
                )
                return ack
            self.outbox.exit(d, ack, written=True)
        else:
            self.outbox.exit(d, ack)
        return ack

    def _unanswered(self, d: Directive, clock: Clock) -> DirectiveAck:
        """Leave ``d`` unanswered and unremembered: it did not act, the disk is unwritable."""
        self.outbox.abandon(d.directive_id)
        log.warning(
            "directive %s %s job %s not acted on and not answered: the state file cannot be "
            "written (the node is fenced out until it can)",
            d.directive_id,
            d.kind.name.lower(),
            d.job_id,
        )
        return self._ack(d, clock, Outcome(AckStatus.FAILED, UNANSWERED.error))

    async def _execute(self, d: Directive, clock: Clock) -> Outcome:
        try:
            async with self._locks.holding(d.job_id, clock.deadline):
                return await self._execute_locked(d, clock)
        except LockWaitExpired:
            return Outcome(
                AckStatus.FAILED,
                f"deadline exceeded after {clock.elapsed():.3f} s waiting for an earlier "
                f"directive of job {d.job_id}",
            )
        finally:
            if not self._locks.busy(d.job_id):
                # Its workers may have left while directives were queued for it.
                self.table.forget_if_gone(d.job_id)

    async def _execute_locked(self, d: Directive, clock: Clock) -> Outcome:
        stale = self._fence(d)
        if stale is not None:
            return stale
        elsewhere = self.table.elsewhere(d.job_id, d.group_id)
        if elsewhere is not None:
            # The job left the directive's group on this node (check_registration), before
            # or after the directive arrived: its processes of that group are gone, and their
            # state with them. Nothing of the job in that group is here to move, as for a job
            # this node never knew; its processes of the other group are not touched.
            # (Refusing instead would fail, again and again, every switch of the old group
            # that still counts the job resident here.)
            log.info(
                "directive %s: job %s is in group %s on this node, not %s: nothing to move",
                d.directive_id,
                d.job_id,
                elsewhere,
                d.group_id,
            )
            return OK_NOTHING
        return await self._procedures[d.kind].run(d, clock)

    # ----- shutdown ----------------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Refuse new directives and give running ones up to ``timeout`` seconds to finish."""
        self._closing = True
        self.durability.closing = True
        running = self._supervisor.running("directive")
        if running:
            log.info("waiting up to %g s for %d running directive(s)", timeout, len(running))
            await asyncio.wait(running, timeout=timeout)
