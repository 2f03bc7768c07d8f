"""NVML (package nvidia-ml-py, import name ``pynvml``): devices, and who holds device memory.

Device discovery is best effort: without a driver (CI, the sim backend on a laptop) it
returns no devices and says why in the log. :class:`NvmlDeviceMemory` measures the memory a
job's processes hold and the devices' free memory, for the checks in
:mod:`timeslice_agent.devmem`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from timeslice_proto.timeslice.v1 import Device

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _discover_blocking() -> list[Device]:
    try:
        import pynvml
    except ImportError:
        log.info("nvml: pynvml is not installed; no devices discovered")
        return []
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError subclasses vary by driver; all mean "no NVML here".
        log.info("nvml: not available (%s); no devices discovered", exc)
        return []
    try:
        devices: list[Device] = []
        for index in range(int(pynvml.nvmlDeviceGetCount())):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(
                Device(
                    index=index,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory_bytes=int(memory.total),
                    uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                )
            )
        return devices
    except Exception as exc:
        log.warning("nvml: device query failed (%s); no devices discovered", exc)
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvml: shutdown failed: %s", exc)


async def discover_devices(timeout: float = 10.0) -> list[Device]:
    """Devices NVML reports, or an empty list; NVML calls run off the event loop."""
    try:
        # asyncio.timeout: wait_for (3.11) can lose a cancel that comes as the call ends.
        async with asyncio.timeout(timeout):
            return await asyncio.to_thread(_discover_blocking)
    except TimeoutError:
        log.warning("nvml: discovery took longer than %g s; no devices discovered", timeout)
        return []


class DeviceMemory(Protocol):
    """What the agent measures of device memory (NVML on a GPU node; a fake in unit tests)."""

    async def held_by(self, pids: Collection[int]) -> int:
        """Device bytes the processes ``pids`` hold, all devices together."""

    async def free_bytes(self) -> int:
        """Free device bytes, all devices together."""

    async def compute_pids(self) -> set[int]:
        """Pids of the processes that have a context on any device."""

    def close(self) -> None:
        """Release what the measurement holds (NVML's handle)."""


class NvmlUnavailable(Exception):
    """NVML cannot be used on this machine; the message says why."""


_NVML_CALL_SECONDS = 10.0


class NvmlDeviceMemory:
    """:class:`DeviceMemory` through NVML, initialised once for the agent's lifetime.

    Every NVML call runs in a worker thread under a deadline: NVML can block for seconds
    when a GPU falls off the bus, and the agent's event loop must keep serving meanwhile.
    """

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable("nvidia-ml-py (pynvml) is not installed") from None
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError subclasses vary by driver.
            raise NvmlUnavailable(f"NVML is not available: {exc}") from None
        self._nvml = pynvml
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvml")
        self._handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(int(pynvml.nvmlDeviceGetCount()))
        ]

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
        try:
            self._nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("nvml: shutdown failed: %s", exc)

    async def _call(self, func: Callable[[], _T]) -> _T:
        # One thread of NVML's own: a hung GPU blocks NVML calls for good, and a call given
        # up on keeps its thread, so they must not pile up in the loop's shared pool (state
        # file writes and driver calls run there).
        future = asyncio.get_running_loop().run_in_executor(self._thread, func)
        try:
            async with asyncio.timeout(_NVML_CALL_SECONDS):
                return await future
        except TimeoutError:
            raise TimeoutError(f"NVML did not answer within {_NVML_CALL_SECONDS:g} s") from None

    def _processes(self) -> list[tuple[int, int]]:
        found: list[tuple[int, int]] = []
        for handle in self._handles:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                # usedGpuMemory is None where the driver cannot attribute memory (some
                # containers); such a process counts as holding nothing measurable.
                used = proc.usedGpuMemory
                found.append((int(proc.pid), int(used) if used is not None else 0))
        return found

    async def held_by(self, pids: Collection[int]) -> int:
        wanted = set(pids)
        return sum(used for pid, used in await self._call(self._processes) if pid in wanted)

    async def free_bytes(self) -> int:
        def free() -> int:
            return sum(int(self._nvml.nvmlDeviceGetMemoryInfo(h).free) for h in self._handles)

        return await self._call(free)

    async def compute_pids(self) -> set[int]:
        return {pid for pid, _ in await self._call(self._processes)}

    async def usage(self) -> list[tuple[str, int, int]]:
        """Per device: (UUID, used bytes, total bytes)."""

        def read() -> list[tuple[str, int, int]]:
            out = []
            for handle in self._handles:
                info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
                out.append((uuid, int(info.used), int(info.total)))
            return out

        return await self._call(read)


def open_device_memory() -> DeviceMemory | None:
    """NVML if it works here, else None (the reason is logged once)."""
    try:
        return NvmlDeviceMemory()
    except NvmlUnavailable as exc:
        log.info("nvml: %s; device memory checks are off", exc)
        return None
