"""Per-job state on this node: an explicit state machine.

::

    IDLE ----------> TRANSITIONING --> SAVED | RUNNING | IDLE | FAULTED
    RUNNING -------> TRANSITIONING
    SAVED ---------> TRANSITIONING
    FAULTED -------> TRANSITIONING
    any state -----> FAULTED (a fault is always recordable)

Only the executor moves jobs, under the job's lock, so two directives for one job never
interleave. An illegal transition is a bug in the agent; it never crashes the process: the job
becomes FAULTED with a reason that names the transition, and the error is logged.

Besides its state a job records where its device state lives (:class:`Residency`), which only
changes when a backend call succeeds; that is what decides whether a checkpoint or restore has
anything to move after a fault.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from timeslice_agent.procs import ProcessIdentity
from timeslice_proto.timeslice.v1 import JobReport
from timeslice_proto.timeslice.v1 import JobState as ProtoJobState

log = logging.getLogger(__name__)


class JobState(enum.Enum):
    """The life cycle of one job's device state on this node."""

    IDLE = "idle"
    TRANSITIONING = "transitioning"
    SAVED = "saved"
    RUNNING = "running"
    FAULTED = "faulted"

    def to_proto(self) -> ProtoJobState:
        return _TO_PROTO[self]


_TO_PROTO: dict[JobState, ProtoJobState] = {
    JobState.IDLE: ProtoJobState.IDLE,
    JobState.TRANSITIONING: ProtoJobState.TRANSITIONING,
    JobState.SAVED: ProtoJobState.SAVED,
    JobState.RUNNING: ProtoJobState.RUNNING,
    JobState.FAULTED: ProtoJobState.FAULTED,
}

_ALLOWED: dict[JobState, frozenset[JobState]] = {
    JobState.IDLE: frozenset({JobState.TRANSITIONING}),
    JobState.RUNNING: frozenset({JobState.TRANSITIONING}),
    JobState.SAVED: frozenset({JobState.TRANSITIONING}),
    JobState.FAULTED: frozenset({JobState.TRANSITIONING}),
    JobState.TRANSITIONING: frozenset(
        {JobState.SAVED, JobState.RUNNING, JobState.IDLE, JobState.FAULTED}
    ),
}


class Residency(enum.Enum):
    """Where a job's device state is: on the accelerators or parked in host memory."""

    DEVICE = "device"
    HOST = "host"


def can_transition(src: JobState, dst: JobState) -> bool:
    """Whether ``src -> dst`` is a legal move (every state may become FAULTED)."""
    return dst is JobState.FAULTED or dst in _ALLOWED[src]


@dataclass
class Job:
    """One job known on this node.

    ``saved_bytes`` are the bytes parked on the host by the last checkpoint (backend plus app
    hooks); ``saved_pids`` are the worker pids it covered, kept so a restart of the agent can
    still resume processes whose registration streams died with it; ``saved_identities`` pin
    them to the processes that were checkpointed, so a reused pid is never resumed.
    """

    job_id: str
    group_id: str
    state: JobState = JobState.IDLE
    residency: Residency = Residency.DEVICE
    reason: str = ""
    saved_bytes: int = 0
    saved_pids: tuple[int, ...] = field(default_factory=tuple)
    saved_identities: tuple[ProcessIdentity, ...] = field(default_factory=tuple)

    def transition(self, dst: JobState, reason: str = "") -> bool:
        """Move to ``dst``; an illegal move faults the job instead and returns False."""
        src = self.state
        if not can_transition(src, dst):
            self.state = JobState.FAULTED
            self.reason = f"internal error: illegal transition {src.value} -> {dst.value}"
            log.error("job %s: %s", self.job_id, self.reason)
            return False
        self.state = dst
        if dst is JobState.FAULTED:
            self.reason = reason or "faulted"
        elif dst is not JobState.TRANSITIONING:
            # A successful move clears an older fault; while transitioning we keep it visible.
            self.reason = reason
        return True

    def fault(self, reason: str) -> None:
        """Record a failure; always legal."""
        self.transition(JobState.FAULTED, reason)

    def settle_saved(
        self,
        saved_bytes: int,
        pids: tuple[int, ...],
        identities: tuple[ProcessIdentity, ...] = (),
    ) -> bool:
        """A checkpoint finished: the state is on the host now."""
        self.residency = Residency.HOST
        self.saved_bytes = saved_bytes
        self.saved_pids = pids
        self.saved_identities = tuple(i for i in identities if i.pid in pids)
        return self.transition(JobState.SAVED)

    def settle_on_device(self, dst: JobState = JobState.RUNNING) -> bool:
        """A restore finished (or a refused move left the state where it was)."""
        self.land_on_device()
        return self.transition(dst)

    def land_on_device(self) -> None:
        """The backend brought the state back; the job stays TRANSITIONING until the app's
        restore hooks ran (:meth:`settle_on_device`), and a hook failure faults it on the
        device, where its state now is."""
        self.residency = Residency.DEVICE
        self.saved_bytes = 0
        self.saved_pids = ()
        self.saved_identities = ()

    @property
    def on_device(self) -> bool:
        return self.residency is Residency.DEVICE

    def report(self) -> JobReport:
        """The wire form sent in AgentHello."""
        return JobReport(
            job_id=self.job_id,
            group_id=self.group_id,
            state=self.state.to_proto(),
            saved_bytes=self.saved_bytes,
            reason=self.reason,
        )
