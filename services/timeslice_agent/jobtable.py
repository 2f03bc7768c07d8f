"""The node's job table: which jobs are here, in which group, and what left.

Each job is a :class:`~timeslice_agent.jobs.Job` state machine; the table decides which jobs
exist. A job is in one group on a node at a time; once nothing of it is left there, it may come
back in another (:meth:`JobTable.check_registration`). A directive of its old group then finds
nothing of the job to move there and is acked OK without acting.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator

from timeslice.errors import InvalidArgument
from timeslice_agent.backends.base import Backend, SavedJob
from timeslice_agent.jobs import Job, JobState, Residency
from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.procs import ProcessIdentity, identity_of, pid_exists
from timeslice_agent.tasks import KeyedLocks
from timeslice_agent.workers import WorkerRegistry
from timeslice_proto.timeslice.v1 import JobReport, WorkerInfo

log = logging.getLogger(__name__)

# Jobs whose left groups are remembered (the oldest are forgotten first); past it, a late
# directive of a group the job left long ago is refused, as before jobs could move.
_LEFT_JOBS = 4096


def _pin(pids: tuple[int, ...]) -> tuple[ProcessIdentity, ...]:
    """The identities of the processes now at ``pids`` (blocking /proc reads)."""
    found = (identity_of(pid) for pid in pids)
    return tuple(i for i in found if i is not None)


class JobTable:
    """The jobs known on this node, keyed by job id.

    ``locks`` are the executor's per-job locks (a job with a directive running or queued is
    still bound here); ``changed`` is called after every change that must reach the state file.
    """

    def __init__(
        self,
        registry: WorkerRegistry,
        locks: KeyedLocks,
        metrics: AgentMetrics,
        changed: Callable[[], None],
    ) -> None:
        self._registry = registry
        self._locks = locks
        self._metrics = metrics
        self._changed = changed
        self.jobs: dict[str, Job] = {}
        # Host memory each restored job's workers said they keep for its next checkpoint
        # (kept pinned copies): already taken, so admission does not ask for it again.
        self.host_kept: dict[str, int] = {}
        # The groups each job left on this node since the agent started (its processes there
        # ended): a late directive of one of them, for the job now in another group here,
        # finds nothing to move instead of being refused as the orchestrator's mistake.
        self._left: dict[str, set[str]] = {}

    def get(self, job_id: str) -> Job | None:
        return self.jobs.get(job_id)

    def parked_bytes(self) -> int:
        """The host memory this node's jobs hold now: the states parked (SAVED) and the host
        copies kept by jobs on the device. Host-memory admission and the host figure the agent
        reports both count from it, so they cannot disagree."""
        return sum(
            job.saved_bytes if job.state is JobState.SAVED else self.host_kept.get(job_id, 0)
            for job_id, job in self.jobs.items()
        )

    def __iter__(self) -> Iterator[Job]:
        return iter(self.jobs.values())

    def copies(self) -> dict[str, Job]:
        """A copy of every job, for a snapshot the writer thread may encode."""
        return {
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
            for k, j in self.jobs.items()
        }

    def reports(self) -> list[JobReport]:
        return [job.report() for _, job in sorted(self.jobs.items())]

    def count(self) -> None:
        """Export the number of jobs in each state."""
        self._metrics.set_jobs(j.state for j in self.jobs.values())

    async def adopt(self, jobs: dict[str, Job], backend: Backend) -> None:
        """Take over the jobs a previous run left; the backend reconciles the parked ones."""
        self.jobs = dict(jobs)
        for job in self.jobs.values():
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
                reason = await backend.reconcile(
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
        self.count()

    # ----- groups ------------------------------------------------------------------------------

    def elsewhere(self, job_id: str, group: str) -> str | None:
        """The group ``job_id`` is in on this node when it is not ``group`` (else None)."""
        job = self.jobs.get(job_id)
        if job is not None:
            here = job.group_id
        else:
            workers = self._registry.workers_of(job_id)
            here = workers[0].group_id if workers else group
        return here if here != group else None

    def left(self, job_id: str, group: str) -> bool:
        """Whether ``job_id`` left ``group`` on this node (its processes there ended)."""
        return group in self._left.get(job_id, ())

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
        job = self.jobs.get(info.job_id)
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
        del self.jobs[job.job_id]
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
        """Keep the table in step with registrations of ``job_id``."""
        workers = self._registry.workers_of(job_id)
        if workers and job_id not in self.jobs:
            self.jobs[job_id] = Job(job_id=job_id, group_id=workers[0].group_id)
        # A worker that came or went changes what the job's workers keep on the host; the
        # next restore says it again.
        self.host_kept.pop(job_id, None)
        self.forget_if_gone(job_id)
        self._changed()

    def forget_if_gone(self, job_id: str) -> None:
        """Drop a job whose processes are gone and of which nothing is parked on this node."""
        job = self.jobs.get(job_id)
        if (
            job is not None
            and job.on_device
            and job.state is not JobState.TRANSITIONING
            and not self._locks.busy(job_id)
            and not self._registry.workers_of(job_id)
        ):
            del self.jobs[job_id]
            self._leave(job_id, job.group_id)

    def _leave(self, job_id: str, group: str) -> None:
        """Remember that ``job_id`` left ``group`` on this node (a bounded memory)."""
        self.host_kept.pop(job_id, None)
        left = self._left.pop(job_id, set())
        left.add(group)
        self._left[job_id] = left  # the most recent last
        while len(self._left) > _LEFT_JOBS:
            del self._left[next(iter(self._left))]
