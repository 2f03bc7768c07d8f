"""Device-memory checks around real moves: a backend's word is not proof that memory is free.

Backends that claim to free the accelerators (``cuda``, ``app``) are checked with NVML:

- **after a checkpoint**, the job's processes must hold no device memory (the ``app`` backend
  allows each process a residual, its CUDA context, which lives as long as the process does).
  Inference engines return from a release before their memory is free, so the check polls up
  to ``release_wait`` seconds before it declares the checkpoint failed;
- **before a restore**, the devices must have free memory for the job's saved bytes; if not,
  the restore is refused with both numbers and nothing moves;
- the bytes reported for a move are NVML's measurement of what the job's processes held, not
  what the workers announced.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from dataclasses import dataclass

from timeslice_agent.backends.base import BackendError, BackendRefused
from timeslice_agent.nvml import DeviceMemory

log = logging.getLogger(__name__)

_POLL_SECONDS = 0.05
_MIB = 1024 * 1024


def _mib(nbytes: int) -> str:
    return f"{nbytes} bytes ({nbytes / _MIB:.0f} MiB)"


@dataclass(frozen=True)
class MemoryCheck:
    """The NVML checks for one backend (see the module docstring)."""

    memory: DeviceMemory
    release_wait: float = 10.0
    residual_per_process: int = 0

    async def measure(self, pids: Collection[int]) -> int:
        """Device bytes ``pids`` hold now."""
        return await self.memory.held_by(pids) if pids else 0

    async def confirm_released(self, job_id: str, pids: Collection[int]) -> int:
        """Wait until ``pids`` hold no more than their residual; raise BackendError if not.

        Returns the bytes they still hold (their residual).
        """
        if not pids:
            return 0
        allowed = self.residual_per_process * len(pids)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.release_wait
        while True:
            held = await self.memory.held_by(pids)
            if held <= allowed:
                return held
            if loop.time() >= deadline:
                allowance = f" (allowed {_mib(allowed)})" if allowed else ""
                raise BackendError(
                    f"checkpoint of job {job_id} did not free device memory: pids "
                    f"{sorted(pids)} still hold {_mib(held)}{allowance} after "
                    f"{self.release_wait:g} s (NVML)"
                )
            await asyncio.sleep(_POLL_SECONDS)

    async def admit_restore(self, job_id: str, needed: int) -> None:
        """Raise :class:`BackendRefused` if the devices cannot take ``needed`` bytes."""
        if needed <= 0:
            return
        free = await self.memory.free_bytes()
        if needed > free:
            raise BackendRefused(
                f"insufficient free device memory to restore job {job_id}: needs "
                f"{_mib(needed)}, devices have {_mib(free)} free (NVML)"
            )
