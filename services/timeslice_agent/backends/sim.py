"""The ``sim`` backend: an EMULATION that models device memory and transfer time.

Nothing is moved. A job's device state is modelled as the sum of its workers' announced
``state_bytes`` (or a configured default when they announced 0); a checkpoint or restore sleeps
``bytes / bandwidth * time_scale`` seconds and updates the model's books. A restore that does
not fit into the modelled capacity (capacity minus the jobs currently on the device, IDLE or
RUNNING, minus restores in flight) is refused before acting. Every result it produces is
labelled emulated (hello, acks, metrics) and every log line it writes says so.

It exists for CI, demos and scheduling benchmarks, where real accelerators are absent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from timeslice_agent.backends.base import (
    Backend,
    BackendError,
    BackendRefused,
    JobContext,
    SavedJob,
    Transfer,
)
from timeslice_agent.config import GB, AgentConfig, SimSettings
from timeslice_proto.timeslice.v1 import Device

log = logging.getLogger(__name__)

_TAG = "[sim emulation]"


def _gb(n: int) -> str:
    return f"{n} bytes ({n / GB:.2f} GB)"


class SimBackend(Backend):
    """Emulated data movement with a capacity and bandwidth model (see the module docstring)."""

    name = "sim"
    emulated = True

    def __init__(
        self,
        settings: SimSettings,
        *,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._settings = settings
        self._sleep = sleep
        # Host-side books: bytes each checkpointed job parks in (modelled) host memory.
        self._host: dict[str, int] = {}
        # Restores in flight reserve their bytes so concurrent restores cannot overcommit.
        self._incoming: dict[str, int] = {}

    @property
    def settings(self) -> SimSettings:
        return self._settings

    @property
    def host_bytes(self) -> int:
        """Modelled bytes parked in host memory, all jobs together."""
        return sum(self._host.values())

    def job_bytes(self, state_bytes: int) -> int:
        """Modelled device bytes of a job whose workers announced ``state_bytes`` in total."""
        return state_bytes if state_bytes > 0 else self._settings.default_state_bytes

    def transfer_seconds(self, nbytes: int) -> float:
        """Modelled time to move ``nbytes`` in one direction."""
        return nbytes / self._settings.bandwidth_bytes_per_s * self._settings.time_scale

    async def _inject(self, kind: str, job: JobContext) -> None:
        for fault in self._settings.faults:
            if fault.applies(kind, job.job_id):
                log.warning("%s injected %s %s for job %s", _TAG, kind, fault.action, job.job_id)
                if fault.action == "hang":
                    await asyncio.Event().wait()  # until the directive's deadline cancels it
                raise BackendError(f"injected {kind} failure (--sim-fault)")

    async def checkpoint(self, job: JobContext) -> Transfer:
        await self._inject("checkpoint", job)
        nbytes = self.job_bytes(job.state_bytes)
        started = time.monotonic()
        # The books change only after the modelled transfer: a cancelled checkpoint moved nothing.
        await self._sleep(self.transfer_seconds(nbytes))
        self._host[job.job_id] = nbytes
        elapsed = time.monotonic() - started
        log.info(
            "%s checkpoint job %s: %s device -> host in %.3f s",
            _TAG,
            job.job_id,
            _gb(nbytes),
            elapsed,
        )
        return Transfer(bytes_moved=nbytes, elapsed_seconds=elapsed)

    def _restore_bytes(self, job: JobContext) -> int:
        if job.job_id in self._host:
            return self._host[job.job_id]
        if job.saved_bytes > 0:
            return job.saved_bytes
        return self.job_bytes(job.state_bytes)

    def free_bytes(self, job: JobContext) -> int:
        """Modelled free device memory as seen by a restore of ``job``."""
        in_use = sum(
            self.job_bytes(r.state_bytes) for r in job.resident if r.job_id != job.job_id
        ) + sum(b for j, b in self._incoming.items() if j != job.job_id)
        return max(self._settings.capacity_bytes - in_use, 0)

    @property
    def capacity_bytes(self) -> int:
        return self._settings.capacity_bytes

    @property
    def default_state_bytes(self) -> int:
        return self._settings.default_state_bytes

    def checkpoint_bytes(self, job: JobContext) -> int:
        return self.job_bytes(job.state_bytes)

    def admit_restore(self, job: JobContext) -> None:
        nbytes = self._restore_bytes(job)
        free = self.free_bytes(job)
        if nbytes > free:
            reason = f"insufficient device memory: need {_gb(nbytes)}, free {_gb(free)} (emulated)"
            log.warning("%s restore job %s refused: %s", _TAG, job.job_id, reason)
            raise BackendRefused(reason)

    async def restore(self, job: JobContext) -> Transfer:
        await self._inject("restore", job)
        # Checked again here: admission and transfer are one step for callers that skip admit.
        self.admit_restore(job)
        nbytes = self._restore_bytes(job)
        self._incoming[job.job_id] = nbytes
        started = time.monotonic()
        try:
            await self._sleep(self.transfer_seconds(nbytes))
        finally:
            del self._incoming[job.job_id]
        self._host.pop(job.job_id, None)
        elapsed = time.monotonic() - started
        log.info(
            "%s restore job %s: %s host -> device in %.3f s",
            _TAG,
            job.job_id,
            _gb(nbytes),
            elapsed,
        )
        return Transfer(bytes_moved=nbytes, elapsed_seconds=elapsed)

    async def reconcile(self, job: SavedJob) -> str | None:
        # The model's books died with the previous process; the state file is the truth.
        self._host[job.job_id] = job.saved_bytes
        log.info(
            "%s re-adopted saved job %s with %s on the host",
            _TAG,
            job.job_id,
            _gb(job.saved_bytes),
        )
        return None

    async def preflight(self) -> None:
        return None  # an emulation: nothing on this machine is needed to move nothing

    def devices(self, discovered: list[Device]) -> list[Device]:
        if discovered:
            return discovered
        return [
            Device(
                index=0,
                name="sim-device (emulated)",
                memory_bytes=self._settings.capacity_bytes,
                uuid="sim-0",
            )
        ]


def create(config: AgentConfig) -> SimBackend:
    """The backend for ``--backend sim`` (see :mod:`timeslice_agent.backends`)."""
    return SimBackend(config.sim)
