"""The checkpoint and restore procedures: one admit-or-refuse prologue, then the move.

Both run under the job's lock, after the executor's fencing checks. Each first decides whether
there is anything to move. If there is, the shared prologue (:meth:`Procedure.admit`) refuses
the move before anything acts (a process of another job among the pids, the backend's own
admission, host memory for a checkpoint) and :meth:`Procedure.guarded` runs it: the job goes
TRANSITIONING (written before acting), and every failure maps to an outcome and a job state:
a refusal before anything acted puts the job back where it was; anything else faults it.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from timeslice_agent.backends.base import (
    Backend,
    BackendError,
    BackendRefused,
    JobContext,
    ResidentJob,
)
from timeslice_agent.devmem import MemoryCheck
from timeslice_agent.discovery import foreign_pids
from timeslice_agent.durability import Durability
from timeslice_agent.hostmem import HostMemory
from timeslice_agent.jobs import Job, JobState
from timeslice_agent.jobtable import JobTable
from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.procs import ProcessIdentity
from timeslice_agent.tasks import run_to_completion
from timeslice_agent.workers import HookFailed, Moved, WorkerRegistry
from timeslice_proto.timeslice.v1 import AckStatus, Directive, HookKind, StaleCause, WorkerInfo

log = logging.getLogger(__name__)

# At most this long for the process scan a checkpoint runs first (the periodic one goes on).
_RESCAN_SECONDS = 2.0


def _earlier(when: float, deadline: float | None) -> float:
    return when if deadline is None else min(when, deadline)


@dataclass(frozen=True)
class Clock:
    """Timing of one directive: loop time at receipt, wall time at receipt, loop deadline."""

    t0: float
    started_at: float
    deadline: float | None

    def elapsed(self) -> float:
        return asyncio.get_running_loop().time() - self.t0


@dataclass(frozen=True)
class Outcome:
    """What a directive came to; the executor turns it into the ack."""

    status: AckStatus
    error: str = ""
    bytes_moved: int = 0
    bytes_skipped: int = 0
    # The job went through TRANSITIONING (written before acting) to a new state: until that
    # state is written too, a restart would take the job for still where it was.
    moved: bool = False
    stale_cause: StaleCause = StaleCause.UNSPECIFIED


OK_NOTHING = Outcome(AckStatus.OK)
# Not acted on, and not answered: the state file cannot be written (the node is being fenced).
UNANSWERED = Outcome(AckStatus.UNSPECIFIED, "the state file cannot be written")


def _merge(
    saved: tuple[ProcessIdentity, ...], live: tuple[ProcessIdentity, ...]
) -> tuple[ProcessIdentity, ...]:
    """One identity per pid: what a checkpoint recorded wins over a later registration, so a
    restore resumes the very process that was checkpointed."""
    pinned = {i.pid: i for i in live}
    pinned.update({i.pid: i for i in saved})
    return tuple(pinned[pid] for pid in sorted(pinned))


@dataclass
class MoveParts:
    """What both procedures act with. ``memory_check`` is set by the agent once NVML is up,
    and only for backends that free device memory."""

    backend: Backend
    registry: WorkerRegistry
    metrics: AgentMetrics
    table: JobTable
    durability: Durability
    hook_timeout: float
    host_memory: HostMemory | None = None
    memory_check: MemoryCheck | None = None
    rescan: Callable[[], Awaitable[None]] | None = None
    # Reads of a job's processes' environment still under way (see Procedure._foreign).
    probes: dict[str, asyncio.Future[list[int]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Admitted:
    """A move the prologue let through: its context, and NVML's bytes measured (or 0)."""

    ctx: JobContext
    measured: int = 0


class Procedure(abc.ABC):
    """The part both procedures share: the prologue and the guarded run."""

    def __init__(self, parts: MoveParts) -> None:
        self.parts = parts

    @abc.abstractmethod
    async def run(self, d: Directive, clock: Clock) -> Outcome:
        """Carry out directive ``d`` on its job: the prologue, then the move."""

    @abc.abstractmethod
    def _backend_admits(self, ctx: JobContext) -> None:
        """Raise BackendRefused if the backend cannot take this move now."""

    async def _fits(self, ctx: JobContext) -> tuple[int, str | None]:
        """NVML's bytes for the move (or 0), and why it would not fit (or None)."""
        return 0, None

    async def admit(self, job: Job, workers: list[WorkerInfo], clock: Clock) -> Admitted | Outcome:
        """The admit-or-refuse prologue: an Outcome is a refusal, nothing having acted."""
        p = self.parts
        ctx = self._context(job, workers)
        foreign = await self._foreign(ctx, clock)
        if foreign is not None:
            return foreign
        try:
            self._backend_admits(ctx)
        except BackendRefused as exc:
            p.metrics.refused.labels("backend").inc()
            return Outcome(AckStatus.REFUSED, exc.reason)
        measured, refusal = await self._fits(ctx)
        if refusal is not None:
            return Outcome(AckStatus.REFUSED, refusal)
        return Admitted(ctx, measured)

    def _context(self, job: Job, workers: list[WorkerInfo]) -> JobContext:
        p = self.parts
        resident: list[ResidentJob] = []
        for other in p.table:
            if other.job_id == job.job_id or not other.on_device:
                continue
            theirs = p.registry.workers_of(other.job_id)
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
            identities=_merge(job.saved_identities, p.registry.identities_of(job.job_id)),
        )

    async def _foreign(self, ctx: JobContext, clock: Clock) -> Outcome | None:
        # procfs reads take the target's mmap lock: off the loop, a stuck process cannot stall
        # it, and within the deadline (a read blocked on such a process never returns).
        # One read per job at a time: a read stuck on such a process keeps its thread, and a
        # new thread per directive would use up the pool every to_thread shares.
        p = self.parts
        stuck = f"(a process stuck in the kernel?): the move of job {ctx.job_id} is refused"
        if ctx.job_id in p.probes:
            p.metrics.refused.labels("foreign_process").inc()
            return Outcome(AckStatus.REFUSED, f"an earlier read is still blocked {stuck}")
        probe = asyncio.ensure_future(asyncio.to_thread(foreign_pids, ctx.job_id, ctx.pids))
        p.probes[ctx.job_id] = probe
        probe.add_done_callback(lambda _: p.probes.pop(ctx.job_id, None))
        try:
            async with asyncio.timeout_at(clock.deadline):
                foreign = await asyncio.shield(probe)
        except TimeoutError:
            p.metrics.refused.labels("foreign_process").inc()
            return Outcome(
                AckStatus.REFUSED,
                f"could not read the environment of pids {list(ctx.pids)} within the "
                f"deadline {stuck}",
            )
        if not foreign:
            return None
        p.metrics.refused.labels("foreign_process").inc()
        reason = (
            f"refusing to move pids {foreign} for job {ctx.job_id}: their environment names "
            "another job"
        )
        log.warning("%s", reason)
        return Outcome(AckStatus.REFUSED, reason)

    async def guarded(
        self,
        job: Job,
        clock: Clock,
        action: Callable[[], Awaitable[Moved]],
        *,
        hooks_acted: Callable[[], bool],
    ) -> Outcome:
        """Run ``action`` (which settles the job on success) under the directive deadline.

        Maps every failure to an outcome and a job state: a refusal before anything acted puts
        the job back where it was; anything else faults it with the reason.
        """
        p = self.parts
        prev_state, prev_reason = job.state, job.reason
        job.transition(JobState.TRANSITIONING)
        p.table.count()
        # One write before acting: the accepted epoch must survive a crash, and a restart
        # must see that this job was mid-move (it then comes back FAULTED, not "fine"). When
        # it fails nothing acts and nothing is answered: the node is fenced out for its disk,
        # not its job faulted (Durability.save reports it).
        if await p.durability.save() is not None:
            job.transition(prev_state, prev_reason)
            p.table.count()
            return UNANSWERED
        scope = asyncio.timeout_at(clock.deadline)
        try:
            async with scope:
                moved = await action()
        except BackendRefused as exc:
            if hooks_acted():
                reason = f"backend refused after the app hooks ran: {exc.reason}"
                job.fault(reason)
                return Outcome(AckStatus.FAILED, reason)
            p.metrics.refused.labels("backend").inc()
            job.transition(prev_state, prev_reason)
            return Outcome(AckStatus.REFUSED, exc.reason)
        except (BackendError, HookFailed) as exc:
            job.fault(exc.reason)
            return Outcome(AckStatus.FAILED, exc.reason)
        except TimeoutError as exc:
            if scope.expired():
                reason = f"deadline exceeded after {clock.elapsed():.3f} s"
            else:
                reason = f"timed out: {exc or 'no detail'}"
            job.fault(reason)
            return Outcome(AckStatus.FAILED, reason)
        finally:
            # No write here: the ack path persists the outcome before the ack is sent.
            p.table.count()
        return Outcome(
            AckStatus.OK,
            bytes_moved=moved.bytes_moved,
            bytes_skipped=moved.bytes_skipped,
            moved=True,
        )


class Checkpoint(Procedure):
    """Move a job's device state to the host."""

    def _backend_admits(self, ctx: JobContext) -> None:
        self.parts.backend.admit_checkpoint(ctx)

    async def _fits(self, ctx: JobContext) -> tuple[int, str | None]:
        check = self.parts.memory_check
        measured = await check.measure(ctx.pids) if check is not None else 0
        refusal = self._host_refusal(ctx, measured)
        if refusal is not None:
            log.warning("checkpoint of %s refused: %s", ctx.job_id, refusal)
            self.parts.metrics.refused.labels("host_memory").inc()
        return measured, refusal

    def _host_refusal(self, ctx: JobContext, measured: int) -> str | None:
        """Why the checkpoint would not fit in host memory; ``measured``: NVML's bytes (or 0).

        Discovered processes announce nothing, so NVML's measurement, where there is one, is
        what the host must take.
        """
        p = self.parts
        if p.host_memory is None:
            return None
        # The job's own kept host copy is taken already (counted in the parked bytes): the
        # checkpoint needs only what it adds to it.
        needed = max(p.backend.checkpoint_bytes(ctx), measured)
        needed -= p.table.host_kept.get(ctx.job_id, 0)
        return p.host_memory.refusal(needed, p.table.parked_bytes())

    async def _refresh_processes(self, clock: Clock) -> None:
        rescan = self.parts.rescan
        if rescan is None:
            return
        # Best effort, and short: a process stuck in the kernel (a hung GPU) can stall a scan
        # for good, and the directive must still answer within its deadline.
        budget = asyncio.get_running_loop().time() + _RESCAN_SECONDS
        try:
            async with asyncio.timeout_at(_earlier(budget, clock.deadline)):
                await rescan()
        except TimeoutError:
            log.warning(
                "process discovery did not finish before a directive; acting on what is known"
            )
        except Exception as exc:
            # The periodic scan keeps trying; this directive acts on what is already known.
            log.warning("process discovery failed before a directive: %r", exc)

    async def run(self, d: Directive, clock: Clock) -> Outcome:
        p = self.parts
        # A process started since the last periodic scan must move with the rest of its job.
        await self._refresh_processes(clock)
        workers = p.registry.workers_of(d.job_id)
        job = p.table.get(d.job_id)
        if job is None:
            if not workers:
                return OK_NOTHING
            job = p.table.jobs[d.job_id] = Job(job_id=d.job_id, group_id=d.group_id)
        if not job.on_device:
            if job.state is not JobState.SAVED:
                # A fault after the state reached the host: it is saved, say so.
                job.transition(JobState.TRANSITIONING)
                job.transition(JobState.SAVED)
                p.table.count()
            return OK_NOTHING
        if not workers:
            return OK_NOTHING
        admitted = await self.admit(job, workers, clock)
        if isinstance(admitted, Outcome):
            return admitted
        ctx, measured = admitted.ctx, admitted.measured
        check = p.memory_check
        hooks_sent = any(w.app_callbacks for w in workers)
        hooks_done = False

        async def action() -> Moved:
            nonlocal hooks_done, measured
            hooks = await p.registry.run_hooks(
                d.job_id, d.group_id, HookKind.BEFORE_CHECKPOINT, p.hook_timeout
            )
            hooks_done = True
            transfer = await p.backend.checkpoint(ctx)
            moved = transfer.moved_pids if transfer.moved_pids is not None else ctx.pids
            if check is not None:
                try:
                    measured -= await check.confirm_released(ctx.job_id, ctx.pids)
                except BaseException:
                    # Memory still held, NVML failing, or the deadline: the backend's move
                    # must not stay half-acknowledged.
                    await self._undo(job, dataclasses.replace(ctx, saved_pids=moved))
                    raise
            # NVML's measurement is the truth where there is one; announced bytes otherwise.
            total = measured if measured > 0 else transfer.bytes_moved + hooks.bytes_moved
            job.settle_saved(total, moved, ctx.identities)
            return Moved(total, min(hooks.bytes_skipped, total))

        return await self.guarded(job, clock, action, hooks_acted=lambda: hooks_sent and hooks_done)

    async def _undo(self, job: Job, ctx: JobContext) -> None:
        """Put back what the backend moved, after the checkpoint failed its NVML check.

        The app's own hooks are undone by the rollback RESTORE the orchestrator sends next: it
        finds the job FAULTED on the device and re-runs the after-restore hooks. If the undo
        fails too, the state is parked on the host, and the job is recorded so, so that a
        later restore brings it back rather than assuming it is on the device.
        """
        try:
            await run_to_completion(self.parts.backend.restore(ctx))
        except BackendError as exc:
            log.error("could not undo the checkpoint of %s: %s", ctx.job_id, exc.reason)
            job.settle_saved(ctx.saved_bytes, ctx.saved_pids, ctx.identities)


class Restore(Procedure):
    """Bring a job's device state back (or, after a fault on the device, its app's side)."""

    def _backend_admits(self, ctx: JobContext) -> None:
        self.parts.backend.admit_restore(ctx)

    async def run(self, d: Directive, clock: Clock) -> Outcome:
        p = self.parts
        job = p.table.get(d.job_id)
        if job is None:
            return OK_NOTHING
        workers = p.registry.workers_of(d.job_id)
        if job.on_device and job.state in (JobState.IDLE, JobState.RUNNING):
            return OK_NOTHING

        async def after_restore_hooks() -> Moved:
            return await p.registry.run_hooks(
                d.job_id, d.group_id, HookKind.AFTER_RESTORE, p.hook_timeout
            )

        if job.on_device:
            # A fault left the state on the device: only the app's side may need redoing.
            async def rerun_hooks() -> Moved:
                hooks = await after_restore_hooks()
                job.settle_on_device(JobState.RUNNING)
                return hooks

            return await self.guarded(job, clock, rerun_hooks, hooks_acted=lambda: False)

        admitted = await self.admit(job, workers, clock)
        if isinstance(admitted, Outcome):
            return admitted
        ctx = admitted.ctx
        check = p.memory_check

        async def action() -> Moved:
            residual = 0
            if check is not None:
                # Refused before anything moves: the executor keeps the job SAVED.
                await check.admit_restore(ctx.job_id, ctx.saved_bytes)
                residual = await check.measure(ctx.pids)
            transfer = await p.backend.restore(ctx)
            job.land_on_device()  # even if a hook fails below, the state is back
            hooks = await after_restore_hooks()
            p.table.host_kept[job.job_id] = hooks.host_bytes_kept
            job.settle_on_device(JobState.RUNNING)
            measured = await check.measure(ctx.pids) - residual if check is not None else 0
            return Moved(measured if measured > 0 else transfer.bytes_moved + hooks.bytes_moved)

        return await self.guarded(job, clock, action, hooks_acted=lambda: False)
