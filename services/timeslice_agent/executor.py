"""Directive execution: fencing, idempotency, per-job serialisation, hooks, deadlines.

Every directive received gets exactly one ack:

1. A directive id seen before is answered with its stored ack, never executed twice
   (:class:`~timeslice_agent.ledger.AckLedger`). A duplicate of a directive still running
   gets the same ack once it is durable.
2. A malformed directive is REFUSED and changes nothing.
3. Fencing: the highest epoch accepted per group is remembered (and persisted before anything
   is acted on). A directive older than that is acked STALE_EPOCH. Equal epochs are accepted:
   the checkpoint and restore of one switch share one. The check runs when the directive
   arrives and again when it gets its job's lock, so a directive that waited behind another
   can never act after a newer authority was accepted for its group. A node that was fenced
   out learns the fence revision in its next Welcome (:meth:`DirectiveExecutor.adopt_fence`):
   every directive with a lower epoch, of any group, is then STALE_EPOCH as well.
4. Directives for different jobs run concurrently, each in its own supervised task; directives
   for one job are serialised by a per-job FIFO lock.
5. ``deadline_ms`` bounds the whole directive (lock wait, hooks, backend); on overrun the work
   is cancelled and the ack is FAILED "deadline exceeded after X s".
6. A directive that arrives while the link says the agent's own event loop was stalled (a
   pause long enough that the orchestrator may have fenced the node) is REFUSED, and not
   remembered: it was most likely waiting in a socket buffer during the pause
   (``docs/fencing.md``).
7. A job is in one group on a node at a time; once nothing of it is left there, it may come
   back in another (:meth:`DirectiveExecutor.check_registration`). A directive of its old group
   then finds nothing of the job to move there and is acked OK without acting.
8. A directive that moved a job's state is acked OK only once the job's new state is in the
   state file. When the state file cannot be written (a full or read-only disk), before acting
   or after, the directive is not answered and the node stops answering directives at all:
   the link tells the orchestrator (``StateUnwritable``), which fences the node out as if it
   had gone silent, so its switches go on without it and no job is faulted for the disk
   (``docs/fencing.md``). The write is retried in the background (at most every
   :data:`UNWRITABLE_RETRY_MAX_SECONDS`); once one succeeds, the link says hello again and the
   node rejoins. An ack remembered but not written is written then, with the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from timeslice_agent.backends.base import (
    Backend,
    BackendError,
    BackendRefused,
    JobContext,
    ResidentJob,
    SavedJob,
)
from timeslice_agent.devmem import MemoryCheck
from timeslice_agent.discovery import foreign_pids
from timeslice_agent.hostmem import HostMemory
from timeslice_agent.jobs import Job, JobState, Residency
from timeslice_agent.journal import DirectiveJournal, JournalEntry
from timeslice_agent.ledger import AckLedger
from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.procs import ProcessIdentity, identity_of, pid_exists
from timeslice_agent.statefile import AgentState, StateStore, StateWriteError
from timeslice_agent.tasks import KeyedLocks, LockWaitExpired, Supervisor, run_to_completion
from timeslice_agent.workers import HookFailed, Moved, WorkerRegistry
from timeslice_proto.timeslice.v1 import (
    AckStatus,
    Directive,
    DirectiveAck,
    DirectiveKind,
    GroupEpoch,
    HookKind,
    JobReport,
    WorkerInfo,
)
from timeslice_proto.timeslice.v1 import JobState as ProtoJobState

log = logging.getLogger(__name__)

MAX_DIRECTIVE_ID_LENGTH = 256
# Jobs whose left groups are remembered (the oldest are forgotten first); past it, a late
# directive of a group the job left long ago is refused, as before jobs could move.
_LEFT_JOBS = 4096
# While the state file cannot be written, the write is retried after these waits (doubling).
UNWRITABLE_RETRY_INITIAL_SECONDS = 0.2
UNWRITABLE_RETRY_MAX_SECONDS = 2.0
# At most this long for the process scan a checkpoint runs first (the periodic one goes on).
_RESCAN_SECONDS = 2.0


def _earlier(when: float, deadline: float | None) -> float:
    return when if deadline is None else min(when, deadline)


@dataclass(frozen=True)
class _Clock:
    """Timing of one directive: loop time at receipt, wall time at receipt, loop deadline."""

    t0: float
    started_at: float
    deadline: float | None

    def elapsed(self) -> float:
        return asyncio.get_running_loop().time() - self.t0


@dataclass(frozen=True)
class _Outcome:
    status: AckStatus
    error: str = ""
    bytes_moved: int = 0
    bytes_skipped: int = 0
    # The job went through TRANSITIONING (written before acting) to a new state: until that
    # state is written too, a restart would take the job for still where it was.
    moved: bool = False


_OK_NOTHING = _Outcome(AckStatus.OK)
# Not acted on, and not answered: the state file cannot be written (the node is being fenced).
_UNANSWERED = _Outcome(AckStatus.UNSPECIFIED, "the state file cannot be written")


def _pin(pids: tuple[int, ...]) -> tuple[ProcessIdentity, ...]:
    """The identities of the processes now at ``pids`` (blocking /proc reads)."""
    found = (identity_of(pid) for pid in pids)
    return tuple(i for i in found if i is not None)


def _merge(
    saved: tuple[ProcessIdentity, ...], live: tuple[ProcessIdentity, ...]
) -> tuple[ProcessIdentity, ...]:
    """One identity per pid: what a checkpoint recorded wins over a later registration, so a
    restore resumes the very process that was checkpointed."""
    pinned = {i.pid: i for i in live}
    pinned.update({i.pid: i for i in saved})
    return tuple(pinned[pid] for pid in sorted(pinned))


class DirectiveExecutor:
    """Executes directives against a backend and keeps the node's job table.

    ``send_ack`` hands an ack to the orchestrator link; it must not block.
    """

    def __init__(
        self,
        *,
        node: str,
        backend: Backend,
        registry: WorkerRegistry,
        metrics: AgentMetrics,
        supervisor: Supervisor,
        state_file: Path,
        hook_timeout: float,
        send_ack: Callable[[DirectiveAck], None],
        journal: DirectiveJournal | None = None,
        tracer: Tracer | None = None,
        host_memory: HostMemory | None = None,
        memory_check: MemoryCheck | None = None,
        rescan: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._node = node
        self._backend = backend
        self._registry = registry
        self._metrics = metrics
        self._supervisor = supervisor
        self._hook_timeout = hook_timeout
        self._send_ack = send_ack
        self._journal = journal
        self._tracer = tracer or trace.NoOpTracer()
        self._host_memory = host_memory
        # Only for backends that free device memory; None without NVML (the checks are then
        # the backend's word, and the log said so at start).
        self.memory_check = memory_check if backend.frees_device_memory else None
        self._rescan = rescan
        # Reads of a job's processes' environment still under way (see _foreign).
        self._probes: dict[str, asyncio.Future[list[int]]] = {}
        self._jobs: dict[str, Job] = {}
        # Host memory each restored job's workers said they keep for its next checkpoint
        # (kept pinned copies): already taken, so admission does not ask for it again.
        self._host_kept: dict[str, int] = {}
        self._epochs: dict[str, int] = {}
        self._fence_revision = 0  # no directive below it acts, whatever its group
        # Why directives must not run now (the link's stall detector), or None.
        self.stalled: Callable[[], str | None] = lambda: None
        # Why the state file cannot be written ("" while it can); told to the link.
        self._unwritable = ""
        self.on_unwritable: Callable[[str], None] = lambda reason: None
        self.on_writable: Callable[[], None] = lambda: None
        # The groups each job left on this node since the agent started (its processes there
        # ended): a late directive of one of them, for the job now in another group here,
        # finds nothing to move instead of being refused as the orchestrator's mistake.
        self._left: dict[str, set[str]] = {}
        self._ledger = AckLedger()
        self._locks = KeyedLocks()  # one per job: its directives run one at a time, in order
        self._closing = False
        self.store = StateStore(state_file, self.snapshot)

    # ----- state, reports, persistence -------------------------------------------------------

    @property
    def jobs(self) -> dict[str, Job]:
        """The job table (read-only by convention; the executor owns it)."""
        return self._jobs

    @property
    def epochs(self) -> dict[str, int]:
        """Highest accepted epoch per group."""
        return dict(self._epochs)

    def snapshot(self) -> AgentState:
        """The durable part of the executor's state."""
        return AgentState(
            node=self._node,
            epochs=dict(self._epochs),
            jobs={
                k: Job(
                    job_id=j.job_id,
                    group_id=j.group_id,
                    state=j.state,
                    residency=j.residency,
                    reason=j.reason,
                    saved_bytes=j.saved_bytes,
                    saved_pids=j.saved_pids,
                    saved_identities=j.saved_identities,
                )
                for k, j in self._jobs.items()
            },
            acks=self._ledger.acks(),
            fence_revision=self._fence_revision,
        )

    def reports(self) -> list[JobReport]:
        return [job.report() for _, job in sorted(self._jobs.items())]

    @property
    def fence_revision(self) -> int:
        """The highest fence revision adopted: no directive with a lower epoch acts."""
        return self._fence_revision

    def adopt_fence(self, revision: int) -> None:
        """The orchestrator fenced this node out at ``revision``: refuse everything older."""
        if revision <= self._fence_revision:
            return
        log.warning(
            "this node was fenced out at revision %d: refusing every directive below it",
            revision,
        )
        self._fence_revision = revision
        self._changed()

    async def settle(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) for running directives, so a hello reports the truth."""
        running = self._supervisor.running("directive")
        if running:
            log.info("waiting up to %g s for %d running directive(s)", timeout, len(running))
            await asyncio.wait(running, timeout=timeout)

    def epoch_list(self) -> list[GroupEpoch]:
        return [GroupEpoch(group_id=g, epoch=e) for g, e in sorted(self._epochs.items())]

    async def adopt(self, state: AgentState | None) -> None:
        """Take over the state a previous run left (before any stream or worker is served)."""
        if state is not None:
            self._epochs = dict(state.epochs)
            self._fence_revision = state.fence_revision
            self._jobs = dict(state.jobs)
            self._ledger.load(state.acks)
        for job in self._jobs.values():
            if job.state is JobState.TRANSITIONING:
                job.fault("the agent restarted during a checkpoint or restore")
            if job.residency is Residency.HOST:
                if job.saved_pids and not job.saved_identities:
                    # A state file from before identities were kept: pin what runs now.
                    job.saved_identities = await asyncio.to_thread(_pin, job.saved_pids)
                    log.warning(
                        "job %s: the state file has no process identities; pinned pids %s as "
                        "they run now",
                        job.job_id,
                        list(job.saved_pids),
                    )
                reason = await self._backend.reconcile(
                    SavedJob(
                        job.job_id,
                        job.group_id,
                        job.saved_bytes,
                        job.saved_pids,
                        job.saved_identities,
                    )
                )
                if reason is not None:
                    job.fault(reason)
            log.info(
                "adopted job %s (group %s): %s%s",
                job.job_id,
                job.group_id,
                job.state.value,
                f" ({job.reason})" if job.reason else "",
            )
        self._metrics.set_jobs(j.state for j in self._jobs.values())

    async def persist(self) -> bool:
        """Write the state file; a failure is logged and counted, never raised."""
        return await self._save() is None

    async def _save(self) -> StateWriteError | None:
        """Write the state file; returns the failure (logged and counted), or None."""
        try:
            await self.store.save()
        except StateWriteError as exc:
            self._metrics.state_write_failures.inc()
            if not self._unwritable:
                log.error("%s", exc)
            self._state_unwritable(exc)
            return exc
        self._state_writable()
        return None

    @property
    def unwritable(self) -> str | None:
        """Why the state file cannot be written, or None while it can."""
        return self._unwritable or None

    def _state_unwritable(self, exc: StateWriteError) -> None:
        """Stop answering directives until a write succeeds; retry it in the background."""
        if self._unwritable:
            return
        self._unwritable = str(exc)
        log.error(
            "the state file %s cannot be written: this node answers no directive until it can "
            "(the orchestrator fences it out); retrying at most every %g s",
            self.store.path,
            UNWRITABLE_RETRY_MAX_SECONDS,
        )
        self.on_unwritable(self._unwritable)
        if not self._closing:  # a stopping agent's last write is not retried
            self._supervisor.spawn(self._retry_writes(), name="state-retry", kind="persist")

    def _state_writable(self) -> None:
        if not self._unwritable:
            return
        self._unwritable = ""
        log.warning("the state file %s can be written again: rejoining", self.store.path)
        self.on_writable()

    async def _retry_writes(self) -> None:
        delay = UNWRITABLE_RETRY_INITIAL_SECONDS
        while self._unwritable:
            await asyncio.sleep(delay)
            delay = min(delay * 2, UNWRITABLE_RETRY_MAX_SECONDS)
            if not self._unwritable:
                return
            try:
                await self.store.save()
            except StateWriteError as exc:
                self._metrics.state_write_failures.inc()
                log.debug("the state file still cannot be written: %s", exc)
                continue
            self._state_writable()

    def _count_jobs(self) -> None:
        self._metrics.set_jobs(j.state for j in self._jobs.values())

    def _changed(self) -> None:
        self._count_jobs()
        self._supervisor.spawn(self.persist(), name="persist", kind="persist")

    # ----- worker registrations ----------------------------------------------------------------

    def check_registration(self, info: WorkerInfo) -> None:
        """Refuse a worker whose job is still bound to another group on this node.

        A job is in one group on a node while anything of it is here: a worker (registered or
        discovered), a directive running or queued, or a checkpoint parked for processes that
        still live. Once none is left, the job may come back in another group, and the old
        binding is dropped as the new worker is accepted. A checkpoint still parked then is
        discarded: it belongs to processes that are gone, so nothing can ever be restored from
        it (every backend parks a job's state in, or with, its own processes: cuda-checkpoint
        in the process's host memory, freeze in the stopped process, app in the app), and its
        bytes went with them. Only the job's record goes; the old group's fencing epoch stays,
        and a late directive of the old group for the job finds nothing to move.
        """
        job = self._jobs.get(info.job_id)
        if job is not None and job.group_id != info.group_id:
            self._move(job, info.group_id)
        left = self._left.get(info.job_id)
        if left is not None:
            left.discard(info.group_id)  # back in a group it left: its directives count again
            if not left:
                del self._left[info.job_id]

    def _move(self, job: Job, group: str) -> None:
        """Let ``job`` come back in ``group``, or raise InvalidArgument saying what binds it."""
        bound = self._bound(job)
        if bound is not None:
            raise InvalidArgument(
                f"job {job.job_id} is in group {job.group_id} on this node, not {group}: {bound}"
            )
        if job.on_device:
            log.info(
                "job %s moves from group %s to %s on this node", job.job_id, job.group_id, group
            )
        else:
            log.warning(
                "job %s moves from group %s to %s on this node: discarding the checkpoint parked "
                "for group %s (%d bytes, state %s), whose processes %s are gone",
                job.job_id,
                job.group_id,
                group,
                job.group_id,
                job.saved_bytes,
                job.state.value,
                list(job.saved_pids),
            )
        del self._jobs[job.job_id]
        self._leave(job.job_id, job.group_id)
        self._changed()

    def _bound(self, job: Job) -> str | None:
        """What still binds ``job`` to its group on this node (None: nothing)."""
        workers = self._registry.workers_of(job.job_id)
        if workers:
            return f"its process(es) {sorted({w.pid for w in workers})} are still there"
        if job.state is JobState.TRANSITIONING or self._locks.busy(job.job_id):
            return "a directive for it is in progress; try again when it is done"
        if not job.on_device:
            alive = [pid for pid in job.saved_pids if pid_exists(pid)]
            if alive:
                return f"its checkpoint is parked for process(es) {alive}, which still live"
        return None

    def on_workers_changed(self, job_id: str) -> None:
        """Keep the job table in step with registrations of ``job_id``."""
        workers = self._registry.workers_of(job_id)
        if workers and job_id not in self._jobs:
            self._jobs[job_id] = Job(job_id=job_id, group_id=workers[0].group_id)
        # A worker that came or went changes what the job's workers keep on the host; the
        # next restore says it again.
        self._host_kept.pop(job_id, None)
        self._forget_if_gone(job_id)
        self._changed()

    def _forget_if_gone(self, job_id: str) -> None:
        """Drop a job whose processes are gone and of which nothing is parked on this node."""
        job = self._jobs.get(job_id)
        if (
            job is not None
            and job.on_device
            and job.state is not JobState.TRANSITIONING
            and not self._locks.busy(job_id)
            and not self._registry.workers_of(job_id)
        ):
            del self._jobs[job_id]
            self._leave(job_id, job.group_id)

    def _leave(self, job_id: str, group: str) -> None:
        """Remember that ``job_id`` left ``group`` on this node (a bounded memory)."""
        self._host_kept.pop(job_id, None)
        left = self._left.pop(job_id, set())
        left.add(group)
        self._left[job_id] = left  # the most recent last
        while len(self._left) > _LEFT_JOBS:
            del self._left[next(iter(self._left))]

    # ----- directives --------------------------------------------------------------------------

    def handle(self, directive: Directive) -> None:
        """Accept one directive from the stream (never blocks; work runs in its own task)."""
        loop = asyncio.get_running_loop()
        did = directive.directive_id
        if self._unwritable:
            # Not answered, not remembered: nothing may act that cannot be made durable, and
            # an ack (even a stored one, perhaps not yet written) would be read as this node's
            # word while the orchestrator is fencing it out for the disk. Sent again, if at
            # all, on the stream of the next hello, once the state file can be written.
            log.warning("directive %s not answered: the state file cannot be written", did)
            self._metrics.refused.labels("unwritable").inc()
            return
        # In flight first: its ack may be remembered already but not yet durable.
        running = self._ledger.running(did)
        if running is not None:
            log.info("directive %s is already running: its ack will be sent again", did)
            self._supervisor.spawn(
                self._ack_when_done(running), name=f"duplicate:{did}", kind="duplicate"
            )
            return
        stored = self._ledger.answered(did)
        if stored is not None:
            log.info("directive %s seen before: re-sending its ack without executing", did)
            self._send_ack(stored)
            return
        t0 = loop.time()
        deadline = t0 + directive.deadline_ms / 1000 if directive.deadline_ms else None
        clock = _Clock(t0=t0, started_at=time.time(), deadline=deadline)
        if self._closing:
            # Not remembered: after a restart the same directive may well be executed.
            self._send_ack(
                self._ack(directive, clock, _Outcome(AckStatus.REFUSED, "agent is shutting down"))
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
                directive, clock, _Outcome(AckStatus.REFUSED, f"invalid directive: {problem}")
            )
            self._exit(directive, ack)
            return
        stale = self._fence(directive)
        if stale is not None:
            self._exit(directive, self._ack(directive, clock, stale))
            return
        self._epochs[directive.group_id] = directive.epoch
        self._ledger.start(did)
        self._supervisor.spawn(
            self._run(directive, clock), name=f"directive:{did}", kind="directive"
        )

    async def _ack_when_done(self, running: asyncio.Future[DirectiveAck]) -> None:
        try:
            ack = await asyncio.shield(running)
        except asyncio.CancelledError:
            if running.cancelled():
                return  # abandoned unanswered (the state file cannot be written)
            raise
        self._send_ack(ack)

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
        elsewhere = self._elsewhere(d)
        if elsewhere is not None and d.group_id not in self._left.get(d.job_id, ()):
            # Not a group the job left here: the orchestrator and this node disagree.
            return f"job {d.job_id} is in group {elsewhere} on this node, not {d.group_id}"
        return None

    def _elsewhere(self, d: Directive) -> str | None:
        """The group the job is in on this node when it is not ``d``'s (else None)."""
        job = self._jobs.get(d.job_id)
        if job is not None:
            group = job.group_id
        else:
            workers = self._registry.workers_of(d.job_id)
            group = workers[0].group_id if workers else d.group_id
        return group if group != d.group_id else None

    def _fence(self, d: Directive) -> _Outcome | None:
        highest = self._epochs.get(d.group_id, 0)
        if d.epoch < self._fence_revision:
            reason = (
                f"stale epoch {d.epoch}: this node was fenced out at revision "
                f"{self._fence_revision}"
            )
        elif d.epoch >= highest:
            return None
        else:
            reason = (
                f"stale epoch {d.epoch}: epoch {highest} was already accepted for group "
                f"{d.group_id}"
            )
        self._metrics.refused.labels("stale_epoch").inc()
        log.warning("directive %s refused: %s", d.directive_id, reason)
        return _Outcome(AckStatus.STALE_EPOCH, reason)

    def _ack(self, d: Directive, clock: _Clock, outcome: _Outcome) -> DirectiveAck:
        job = self._jobs.get(d.job_id)
        return DirectiveAck(
            directive_id=d.directive_id,
            group_id=d.group_id,
            epoch=d.epoch,
            status=outcome.status,
            error=outcome.error,
            bytes_moved=outcome.bytes_moved,
            bytes_skipped=outcome.bytes_skipped,
            moved=outcome.moved,
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

    def _exit(self, d: Directive, ack: DirectiveAck, *, written: bool = False) -> None:
        """The one way a directive's ack leaves: remembered now, then persisted and sent.

        Remembered at once, so a re-send arriving before the state file is written is answered
        from the ledger (or waits for this ack), never executed or fenced a second time.
        ``written``: the state file already holds this ack (:meth:`_durable`).
        """
        if d.directive_id:
            self._remember(d, ack)
        self._supervisor.spawn(
            self._publish(d, ack, written=written), name=f"ack:{d.directive_id}", kind="directive"
        )

    def _remember(self, d: Directive, ack: DirectiveAck) -> None:
        self._ledger.remember(ack)
        kind = d.kind.name.lower() if isinstance(d.kind, DirectiveKind) else "unspecified"
        self._metrics.observe_directive(
            kind, ack.status.name.lower(), ack.elapsed_seconds, ack.bytes_moved, ack.bytes_skipped
        )

    async def _publish(self, d: Directive, ack: DirectiveAck, *, written: bool = False) -> None:
        if not written:
            # Written before the orchestrator hears of it where the disk allows. An ack that
            # reports a move never gets here unwritten as OK (_durable); any other is sent
            # even when this write fails: it claims no new state a restart could lose.
            await self.persist()
        self._ledger.release(ack)
        if self._journal is not None:
            self._journal.record(JournalEntry.of(self._node, d, ack))
        self._send_ack(ack)
        level = logging.INFO if ack.status is AckStatus.OK else logging.WARNING
        log.log(
            level,
            "directive %s %s job %s epoch %d: %s%s bytes=%d (skipped %d) in %.3f s%s",
            d.directive_id,
            d.kind.name.lower(),
            d.job_id,
            d.epoch,
            ack.status.name,
            f" ({ack.error})" if ack.error else "",
            ack.bytes_moved,
            ack.bytes_skipped,
            ack.elapsed_seconds,
            " [emulated]" if ack.emulated else "",
        )

    async def _run(self, d: Directive, clock: _Clock) -> None:
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

    async def _run_untraced(self, d: Directive, clock: _Clock) -> DirectiveAck:
        try:
            outcome = await self._execute(d, clock)
            if outcome is _UNANSWERED:
                return self._unanswered(d, clock)
        except asyncio.CancelledError:
            reason = "interrupted: the agent stopped during the directive"
            job = self._jobs.get(d.job_id)
            if job is not None and job.state is JobState.TRANSITIONING:
                job.fault(reason)
            # Remembered, not published: the agent is stopping (shutdown persists the state).
            ack = self._ack(d, clock, _Outcome(AckStatus.FAILED, reason))
            self._remember(d, ack)
            self._ledger.release(ack)
            raise
        except Exception as exc:
            # A bug, not a backend failure: keep the agent alive and make it visible.
            log.exception("directive %s: internal error", d.directive_id)
            reason = f"internal error: {exc!r}"
            job = self._jobs.get(d.job_id)
            if job is not None and job.state is JobState.TRANSITIONING:
                job.fault(reason)
            outcome = _Outcome(AckStatus.FAILED, reason)
        ack = self._ack(d, clock, outcome)
        if outcome.moved and ack.status is AckStatus.OK:
            if not await self._durable(ack):
                self._ledger.abandon(d.directive_id)
                log.warning(
                    "directive %s %s job %s: done, but not answered: its outcome cannot be "
                    "written to the state file (the node is fenced out until it can)",
                    d.directive_id,
                    d.kind.name.lower(),
                    d.job_id,
                )
                return ack
            self._exit(d, ack, written=True)
        else:
            self._exit(d, ack)
        return ack

    def _unanswered(self, d: Directive, clock: _Clock) -> DirectiveAck:
        """Leave ``d`` unanswered and unremembered: it did not act, the disk is unwritable."""
        self._ledger.abandon(d.directive_id)
        log.warning(
            "directive %s %s job %s not acted on and not answered: the state file cannot be "
            "written (the node is fenced out until it can)",
            d.directive_id,
            d.kind.name.lower(),
            d.job_id,
        )
        return self._ack(d, clock, _Outcome(AckStatus.FAILED, _UNANSWERED.error))

    async def _durable(self, ack: DirectiveAck) -> bool:
        """Whether the job's new state and ``ack`` itself are written.

        Until then the file says the job is TRANSITIONING from where it was (the write before
        acting), and a restarted agent faults it there, not where its state now is: a later
        restore would only re-run the app's hooks of a job whose state is parked, a later
        checkpoint would save nothing of one whose state is on the devices. So an OK is sent
        only once written. When the write fails, nothing is sent: the node stops answering
        and is fenced out (its switches go on without it, none of its jobs faulted for the
        disk), and its next hello, once the file can be written, reports where the job's
        state really is. The job in memory stays as the move left it, which is the truth the
        following directives act on, and the ack stays in the ledger, to be written with the
        next successful write.
        """
        # In the ledger before the write, so the one write that settles the job carries its
        # ack too: a re-send after a restart is answered, never executed again.
        self._ledger.remember(ack)
        try:
            return await self._save() is None
        except asyncio.CancelledError:
            # As for a directive interrupted while it acted: the agent is stopping, and its
            # shutdown writes the state (with this ack) where the disk allows.
            self._ledger.release(ack)
            raise

    async def _execute(self, d: Directive, clock: _Clock) -> _Outcome:
        try:
            async with self._locks.holding(d.job_id, clock.deadline):
                return await self._execute_locked(d, clock)
        except LockWaitExpired:
            return _Outcome(
                AckStatus.FAILED,
                f"deadline exceeded after {clock.elapsed():.3f} s waiting for an earlier "
                f"directive of job {d.job_id}",
            )
        finally:
            if not self._locks.busy(d.job_id):
                # Its workers may have left while directives were queued for it.
                self._forget_if_gone(d.job_id)

    async def _execute_locked(self, d: Directive, clock: _Clock) -> _Outcome:
        stale = self._fence(d)
        if stale is not None:
            return stale
        elsewhere = self._elsewhere(d)
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
            return _OK_NOTHING
        if d.kind is DirectiveKind.CHECKPOINT:
            return await self._checkpoint(d, clock)
        return await self._restore(d, clock)

    def _context(self, job: Job, workers: list[WorkerInfo]) -> JobContext:
        resident: list[ResidentJob] = []
        for other in self._jobs.values():
            if other.job_id == job.job_id or not other.on_device:
                continue
            theirs = self._registry.workers_of(other.job_id)
            # A job with no live worker has no process holding device memory.
            if theirs:
                resident.append(ResidentJob(other.job_id, sum(w.state_bytes for w in theirs)))
        return JobContext(
            job_id=job.job_id,
            group_id=job.group_id,
            workers=tuple(workers),
            state_bytes=sum(w.state_bytes for w in workers),
            saved_bytes=job.saved_bytes,
            saved_pids=job.saved_pids,
            resident=tuple(resident),
            identities=_merge(job.saved_identities, self._registry.identities_of(job.job_id)),
        )

    async def _guarded(
        self,
        job: Job,
        clock: _Clock,
        action: Callable[[], Awaitable[Moved]],
        *,
        hooks_acted: Callable[[], bool],
    ) -> _Outcome:
        """Run ``action`` (which settles the job on success) under the directive deadline.

        Maps every failure to an outcome and a job state: a refusal before anything acted puts
        the job back where it was; anything else faults it with the reason.
        """
        prev_state, prev_reason = job.state, job.reason
        job.transition(JobState.TRANSITIONING)
        self._count_jobs()
        # One write before acting: the accepted epoch must survive a crash, and a restart
        # must see that this job was mid-move (it then comes back FAULTED, not "fine"). When
        # it fails nothing acts and nothing is answered: the node is fenced out for its disk,
        # not its job faulted (_save reports it).
        if await self._save() is not None:
            job.transition(prev_state, prev_reason)
            self._count_jobs()
            return _UNANSWERED
        scope = asyncio.timeout_at(clock.deadline)
        try:
            async with scope:
                moved = await action()
        except BackendRefused as exc:
            if hooks_acted():
                reason = f"backend refused after the app hooks ran: {exc.reason}"
                job.fault(reason)
                return _Outcome(AckStatus.FAILED, reason)
            self._metrics.refused.labels("backend").inc()
            job.transition(prev_state, prev_reason)
            return _Outcome(AckStatus.REFUSED, exc.reason)
        except (BackendError, HookFailed) as exc:
            job.fault(exc.reason)
            return _Outcome(AckStatus.FAILED, exc.reason)
        except TimeoutError as exc:
            if scope.expired():
                reason = f"deadline exceeded after {clock.elapsed():.3f} s"
            else:
                reason = f"timed out: {exc or 'no detail'}"
            job.fault(reason)
            return _Outcome(AckStatus.FAILED, reason)
        finally:
            # No write here: the ack path persists the outcome before the ack is sent.
            self._count_jobs()
        return _Outcome(
            AckStatus.OK,
            bytes_moved=moved.bytes_moved,
            bytes_skipped=moved.bytes_skipped,
            moved=True,
        )

    def _host_refusal(self, ctx: JobContext, measured: int) -> str | None:
        """Why the checkpoint would not fit in host memory; ``measured``: NVML's bytes (or 0).

        Discovered processes announce nothing, so NVML's measurement, where there is one, is
        what the host must take.
        """
        if self._host_memory is None:
            return None
        parked = sum(j.saved_bytes for j in self._jobs.values() if j.state is JobState.SAVED)
        # A job on the device whose workers keep a host copy holds that memory too (a
        # modelled host must count it; the kernel's MemAvailable already does).
        parked += sum(
            kept
            for job_id, kept in self._host_kept.items()
            if job_id != ctx.job_id
            and (job := self._jobs.get(job_id)) is not None
            and job.state is not JobState.SAVED
        )
        needed = max(self._backend.checkpoint_bytes(ctx), measured)
        needed -= self._host_kept.get(ctx.job_id, 0)
        return self._host_memory.refusal(needed, parked)

    async def _foreign(self, ctx: JobContext, clock: _Clock) -> _Outcome | None:
        # procfs reads take the target's mmap lock: off the loop, a stuck process cannot stall
        # it, and within the deadline (a read blocked on such a process never returns).
        # One read per job at a time: a read stuck on such a process keeps its thread, and a
        # new thread per directive would use up the pool every to_thread shares.
        stuck = f"(a process stuck in the kernel?): the move of job {ctx.job_id} is refused"
        if ctx.job_id in self._probes:
            self._metrics.refused.labels("foreign_process").inc()
            return _Outcome(AckStatus.REFUSED, f"an earlier read is still blocked {stuck}")
        probe = asyncio.ensure_future(asyncio.to_thread(foreign_pids, ctx.job_id, ctx.pids))
        self._probes[ctx.job_id] = probe
        probe.add_done_callback(lambda _: self._probes.pop(ctx.job_id, None))
        try:
            async with asyncio.timeout_at(clock.deadline):
                foreign = await asyncio.shield(probe)
        except TimeoutError:
            self._metrics.refused.labels("foreign_process").inc()
            return _Outcome(
                AckStatus.REFUSED,
                f"could not read the environment of pids {list(ctx.pids)} within the "
                f"deadline {stuck}",
            )
        if not foreign:
            return None
        self._metrics.refused.labels("foreign_process").inc()
        reason = (
            f"refusing to move pids {foreign} for job {ctx.job_id}: their environment names "
            "another job"
        )
        log.warning("%s", reason)
        return _Outcome(AckStatus.REFUSED, reason)

    async def _refresh_processes(self, clock: _Clock) -> None:
        if self._rescan is None:
            return
        # Best effort, and short: a process stuck in the kernel (a hung GPU) can stall a scan
        # for good, and the directive must still answer within its deadline.
        budget = asyncio.get_running_loop().time() + _RESCAN_SECONDS
        try:
            async with asyncio.timeout_at(_earlier(budget, clock.deadline)):
                await self._rescan()
        except TimeoutError:
            log.warning(
                "process discovery did not finish before a directive; acting on what is known"
            )
        except Exception as exc:
            # The periodic scan keeps trying; this directive acts on what is already known.
            log.warning("process discovery failed before a directive: %r", exc)

    async def _checkpoint(self, d: Directive, clock: _Clock) -> _Outcome:
        # A process started since the last periodic scan must move with the rest of its job.
        await self._refresh_processes(clock)
        workers = self._registry.workers_of(d.job_id)
        job = self._jobs.get(d.job_id)
        if job is None:
            if not workers:
                return _OK_NOTHING
            job = self._jobs[d.job_id] = Job(job_id=d.job_id, group_id=d.group_id)
        if not job.on_device:
            if job.state is not JobState.SAVED:
                # A fault after the state reached the host: it is saved, say so.
                job.transition(JobState.TRANSITIONING)
                job.transition(JobState.SAVED)
                self._count_jobs()
            return _OK_NOTHING
        if not workers:
            return _OK_NOTHING
        ctx = self._context(job, workers)
        foreign = await self._foreign(ctx, clock)
        if foreign is not None:
            return foreign
        try:
            self._backend.admit_checkpoint(ctx)
        except BackendRefused as exc:
            self._metrics.refused.labels("backend").inc()
            return _Outcome(AckStatus.REFUSED, exc.reason)
        check = self.memory_check
        measured = await check.measure(ctx.pids) if check is not None else 0
        refusal = self._host_refusal(ctx, measured)
        if refusal is not None:
            log.warning("checkpoint of %s refused: %s", d.job_id, refusal)
            self._metrics.refused.labels("host_memory").inc()
            return _Outcome(AckStatus.REFUSED, refusal)
        hooks_sent = any(w.app_callbacks for w in workers)
        hooks_done = False

        async def action() -> Moved:
            nonlocal hooks_done, measured
            hooks = await self._registry.run_hooks(
                d.job_id, d.group_id, HookKind.BEFORE_CHECKPOINT, self._hook_timeout
            )
            hooks_done = True
            transfer = await self._backend.checkpoint(ctx)
            moved = transfer.moved_pids if transfer.moved_pids is not None else ctx.pids
            if check is not None:
                try:
                    measured -= await check.confirm_released(ctx.job_id, ctx.pids)
                except BaseException:
                    # Memory still held, NVML failing, or the deadline: the backend's move
                    # must not stay half-acknowledged.
                    await self._undo_checkpoint(job, dataclasses.replace(ctx, saved_pids=moved))
                    raise
            # NVML's measurement is the truth where there is one; announced bytes otherwise.
            total = measured if measured > 0 else transfer.bytes_moved + hooks.bytes_moved
            job.settle_saved(total, moved, ctx.identities)
            return Moved(total, min(hooks.bytes_skipped, total))

        return await self._guarded(
            job, clock, action, hooks_acted=lambda: hooks_sent and hooks_done
        )

    async def _undo_checkpoint(self, job: Job, ctx: JobContext) -> None:
        """Put back what the backend moved, after the checkpoint failed its NVML check.

        The app's own hooks are undone by the rollback RESTORE the orchestrator sends next: it
        finds the job FAULTED on the device and re-runs the after-restore hooks. If the undo
        fails too, the state is parked on the host, and the job is recorded so, so that a
        later restore brings it back rather than assuming it is on the device.
        """
        try:
            await run_to_completion(self._backend.restore(ctx))
        except BackendError as exc:
            log.error("could not undo the checkpoint of %s: %s", ctx.job_id, exc.reason)
            job.settle_saved(ctx.saved_bytes, ctx.saved_pids, ctx.identities)

    async def _restore(self, d: Directive, clock: _Clock) -> _Outcome:
        job = self._jobs.get(d.job_id)
        if job is None:
            return _OK_NOTHING
        workers = self._registry.workers_of(d.job_id)
        if job.on_device and job.state in (JobState.IDLE, JobState.RUNNING):
            return _OK_NOTHING

        async def after_restore_hooks() -> Moved:
            return await self._registry.run_hooks(
                d.job_id, d.group_id, HookKind.AFTER_RESTORE, self._hook_timeout
            )

        if job.on_device:
            # A fault left the state on the device: only the app's side may need redoing.
            async def rerun_hooks() -> Moved:
                hooks = await after_restore_hooks()
                job.settle_on_device(JobState.RUNNING)
                return hooks

            return await self._guarded(job, clock, rerun_hooks, hooks_acted=lambda: False)

        ctx = self._context(job, workers)
        foreign = await self._foreign(ctx, clock)
        if foreign is not None:
            return foreign
        try:
            self._backend.admit_restore(ctx)
        except BackendRefused as exc:
            self._metrics.refused.labels("backend").inc()
            return _Outcome(AckStatus.REFUSED, exc.reason)
        check = self.memory_check

        async def action() -> Moved:
            residual = 0
            if check is not None:
                # Refused before anything moves: the executor keeps the job SAVED.
                await check.admit_restore(ctx.job_id, ctx.saved_bytes)
                residual = await check.measure(ctx.pids)
            transfer = await self._backend.restore(ctx)
            job.land_on_device()  # even if a hook fails below, the state is back
            hooks = await after_restore_hooks()
            self._host_kept[job.job_id] = hooks.host_bytes_kept
            job.settle_on_device(JobState.RUNNING)
            measured = await check.measure(ctx.pids) - residual if check is not None else 0
            return Moved(measured if measured > 0 else transfer.bytes_moved + hooks.bytes_moved)

        return await self._guarded(job, clock, action, hooks_acted=lambda: False)

    # ----- shutdown ----------------------------------------------------------------------------

    async def drain(self, timeout: float) -> None:
        """Refuse new directives and give running ones up to ``timeout`` seconds to finish."""
        self._closing = True
        running = self._supervisor.running("directive")
        if running:
            log.info("waiting up to %g s for %d running directive(s)", timeout, len(running))
            await asyncio.wait(running, timeout=timeout)
