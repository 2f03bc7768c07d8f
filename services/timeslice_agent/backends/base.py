"""The narrow interface every data-movement backend implements.

A backend moves one job's device state between the accelerators and host memory. The executor
owns job state, fencing, hooks and deadlines; a backend only acts, and reports what it moved.
It must leave nothing half-done when it raises: either the whole job moved or nothing did.
"""

from __future__ import annotations

import abc
import asyncio
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from timeslice_agent.peers import target_refusal
from timeslice_agent.procs import ProcessIdentity
from timeslice_proto.timeslice.v1 import Device, WorkerInfo


class BackendError(Exception):
    """The backend tried and failed; the directive is acked FAILED with ``reason``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BackendUnavailable(Exception):
    """The backend cannot run on this machine (no driver, no binary, no right to act); the
    message says what is missing and how to fix it.

    Raised by a backend's ``create`` or :meth:`Backend.preflight`; the agent then refuses to
    start (exit status 2, one line): it never falls back to another backend.
    """


class BackendRefused(BackendError):
    """The backend declined before acting (admission, safety); acked REFUSED, nothing changed."""


@dataclass(frozen=True)
class ResidentJob:
    """Another job whose device state currently occupies this node's accelerators."""

    job_id: str
    state_bytes: int


@dataclass(frozen=True)
class JobContext:
    """What a backend may know about the job it moves.

    ``state_bytes`` is the sum of the workers' announced device bytes (0 when unknown);
    ``saved_bytes`` and ``saved_pids`` describe the last checkpoint when the job is on the host;
    ``resident`` lists the other jobs on the device, for admission decisions;
    ``identities`` pins each pid to the process that was registered (or discovered, or
    checkpointed): a backend that acts on processes checks them with :func:`check_targets`.
    """

    job_id: str
    group_id: str
    workers: tuple[WorkerInfo, ...] = ()
    state_bytes: int = 0
    saved_bytes: int = 0
    saved_pids: tuple[int, ...] = ()
    resident: tuple[ResidentJob, ...] = field(default_factory=tuple)
    identities: tuple[ProcessIdentity, ...] = ()

    def identity(self, pid: int) -> ProcessIdentity | None:
        """The pinned identity of ``pid`` (None: the job never registered that process)."""
        for identity in self.identities:
            if identity.pid == pid:
                return identity
        return None

    @property
    def pids(self) -> tuple[int, ...]:
        """Distinct pids of the job: registered workers plus those of its last checkpoint."""
        return tuple(sorted({w.pid for w in self.workers} | set(self.saved_pids)))


async def check_targets(
    job: JobContext, pids: Iterable[int], *, own_pid: int | None = None
) -> None:
    """Raise :class:`BackendRefused` unless every pid is still the job's pinned process.

    Called right before a backend signals or checkpoints (see :mod:`timeslice_agent.peers`):
    never pid 0 or 1, never the agent, never a pid reused by another process, never one whose
    uid changed or whose environment names another job. The /proc reads run off the loop.
    """
    me = os.getpid() if own_pid is None else own_pid
    chosen = tuple(pids)

    def refusals() -> list[str]:
        found = (target_refusal(p, job.identity(p), job.job_id, own_pid=me) for p in chosen)
        return [r for r in found if r is not None]

    refused = await asyncio.to_thread(refusals)
    if refused:
        raise BackendRefused(f"job {job.job_id}: {'; '.join(refused)}")


@dataclass(frozen=True)
class Transfer:
    """The result of one backend move.

    ``moved_pids``: the processes a checkpoint really moved, when the backend chose among the
    job's pids (None: all of them). They are the ones a restore brings back.
    """

    bytes_moved: int
    elapsed_seconds: float
    moved_pids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SavedJob:
    """A job the durable state file says is parked on the host, for :meth:`Backend.reconcile`."""

    job_id: str
    group_id: str
    saved_bytes: int
    saved_pids: tuple[int, ...]
    identities: tuple[ProcessIdentity, ...] = ()


class Backend(abc.ABC):
    """A pluggable way to move device state.

    ``emulated`` is True when nothing is really moved (the sim backend); it is reported with
    every hello, ack, log line and metric so modelled numbers are never mistaken for real ones.
    ``frees_device_memory`` is True for backends whose checkpoint must leave the job's
    processes without device memory; the agent then verifies that with NVML
    (:mod:`timeslice_agent.devmem`), allowing each process ``residual_bytes_per_process``.
    ``mechanism`` names the path that really runs (``driver-api`` or ``cli`` for cuda); it is
    logged, sent in the hello and exported as a metric label.
    """

    name: str
    emulated: bool
    frees_device_memory: bool = False
    residual_bytes_per_process: int = 0

    @property
    def mechanism(self) -> str:
        """The path that moves state (defaults to the backend's name)."""
        return self.name

    def admit_checkpoint(self, job: JobContext) -> None:
        """Raise :class:`BackendRefused` if a checkpoint of ``job`` must not even start.

        Called before the app's before-checkpoint hooks run, so a refusal changes nothing.
        The default admits everything.
        """
        return None

    @property
    def capacity_bytes(self) -> int:
        """Device bytes several jobs' states can share; 0 = one job's state at a time."""
        return 0

    @property
    def default_state_bytes(self) -> int:
        """Device bytes of a job whose workers announced none (0: unknown)."""
        return 0

    def checkpoint_bytes(self, job: JobContext) -> int:
        """Host bytes a checkpoint of ``job`` will take (for host-memory admission)."""
        return job.state_bytes

    def admit_restore(self, job: JobContext) -> None:
        """Raise :class:`BackendRefused` if a restore of ``job`` must not even start."""
        return None

    @abc.abstractmethod
    async def preflight(self) -> None:
        """Check, before the agent starts, that this backend can act on this machine.

        Raises :class:`BackendUnavailable` naming what is missing and how to fix it, so that
        a node that could not move a job's state refuses to start instead of failing at its
        first switch. Runs once, before the worker socket exists and before any job is known.
        """

    @abc.abstractmethod
    async def checkpoint(self, job: JobContext) -> Transfer:
        """Move the job's device state to host memory."""

    @abc.abstractmethod
    async def restore(self, job: JobContext) -> Transfer:
        """Bring the job's device state back onto the accelerators."""

    @abc.abstractmethod
    async def reconcile(self, job: SavedJob) -> str | None:
        """Re-adopt a job that was SAVED before the agent restarted.

        Returns None when the job can stay SAVED, else the reason it cannot (it is then FAULTED).
        """

    @abc.abstractmethod
    def devices(self, discovered: list[Device]) -> list[Device]:
        """The devices to announce, given those NVML found (possibly none)."""
