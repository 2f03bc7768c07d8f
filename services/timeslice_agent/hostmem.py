"""Host-memory admission: a checkpoint that would not fit in host memory is refused up front.

Parking a job's device state in host DRAM must never push the node into the OOM killer (which
would take the job, or the agent, with it). Before a checkpoint starts, the agent compares the
bytes it will park with what the host can still give, less a reserve kept for everything
else; a checkpoint that does not fit is refused with the numbers, and the orchestrator rolls
the switch back cleanly.

Available memory is the kernel's ``MemAvailable`` (``/proc/meminfo``), which already accounts
for states parked earlier; with a modelled host size (``--host-memory-gb``, for the sim
backend and tests) it is that size minus the bytes this agent has parked
(:meth:`~timeslice_agent.jobtable.JobTable.parked_bytes`). The same figure goes to the
orchestrator in the agent's hello and every heartbeat (:meth:`HostMemory.report`), for the
dashboard's nodes view.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MEMINFO = Path("/proc/meminfo")
GB = 1_000_000_000


def mem_available(meminfo: Path = MEMINFO) -> int:
    """``MemAvailable`` in bytes (0 if the kernel does not say)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


@dataclass(frozen=True, slots=True)
class HostMemory:
    reserve_bytes: int
    modelled_bytes: int = 0  # 0: use the kernel's MemAvailable

    def available(self, parked_bytes: int) -> int:
        if self.modelled_bytes:
            return self.modelled_bytes - parked_bytes
        return mem_available()

    @property
    def modelled(self) -> bool:
        """True when the figures are a modelled host's (an emulated figure, not a reading)."""
        return self.modelled_bytes > 0

    def report(self, parked_bytes: int) -> int | None:
        """What the agent reports as host memory free: :meth:`available` (never below 0), or
        None when the kernel cannot be read (no ``/proc/meminfo``): the orchestrator then shows
        "not reported" rather than a guess."""
        try:
            return max(0, self.available(parked_bytes))
        except (OSError, ValueError):
            return None

    def refusal(self, needed_bytes: int, parked_bytes: int) -> str | None:
        """Why a checkpoint of ``needed_bytes`` must not start, or None if it fits."""
        if needed_bytes <= 0:
            return None
        available = self.available(parked_bytes)
        if needed_bytes + self.reserve_bytes <= available:
            return None
        return (
            f"host memory admission: the checkpoint needs {needed_bytes / GB:.2f} GB but only "
            f"{available / GB:.2f} GB of host memory is available and "
            f"{self.reserve_bytes / GB:.2f} GB is reserved"
        )
