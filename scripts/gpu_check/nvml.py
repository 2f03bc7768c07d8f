"""NVML through ``pynvml`` (package nvidia-ml-py): who holds device memory, and machine facts.

Everything here fails soft: a machine without NVML (or a sandbox that hides it) yields
:class:`NvmlMissing` with the reason, which the check records as "skipped: no NVML".
"""

from __future__ import annotations

from typing import Any


class NvmlMissing(Exception):
    """NVML cannot be used here; the message says why."""


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """An initialised NVML session (close it, or use it as a context manager)."""

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise NvmlMissing("nvidia-ml-py (pynvml) is not installed") from None
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError subclasses differ by driver; all mean "no NVML"
            raise NvmlMissing(f"nvmlInit failed: {exc}") from None
        self._nvml: Any = pynvml
        self._handles = [
            pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(int(pynvml.nvmlDeviceGetCount()))
        ]

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # shutting down a broken NVML has nothing left to report
            pass

    def held_by_pid(self) -> dict[int, int]:
        """Device bytes per pid, over all devices (compute processes)."""
        held: dict[int, int] = {}
        for handle in self._handles:
            for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                # None where the driver cannot attribute memory (some containers).
                used = int(proc.usedGpuMemory) if proc.usedGpuMemory is not None else 0
                held[int(proc.pid)] = held.get(int(proc.pid), 0) + used
        return held

    def machine(self) -> dict[str, Any]:
        """Driver, CUDA driver version and per-device facts (name, memory, PCIe link)."""
        nv = self._nvml
        cuda = int(nv.nvmlSystemGetCudaDriverVersion())
        info: dict[str, Any] = {
            "driver_version": _text(nv.nvmlSystemGetDriverVersion()),
            "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}",
            "devices": [],
        }
        for index, handle in enumerate(self._handles):
            memory = nv.nvmlDeviceGetMemoryInfo(handle)
            device: dict[str, Any] = {
                "index": index,
                "name": _text(nv.nvmlDeviceGetName(handle)),
                "memory_total_bytes": int(memory.total),
                "memory_used_bytes": int(memory.used),
            }
            for key, call in (
                ("pcie_gen_max", nv.nvmlDeviceGetMaxPcieLinkGeneration),
                ("pcie_gen_current", nv.nvmlDeviceGetCurrPcieLinkGeneration),
                ("pcie_width_max", nv.nvmlDeviceGetMaxPcieLinkWidth),
                ("pcie_width_current", nv.nvmlDeviceGetCurrPcieLinkWidth),
            ):
                try:
                    device[key] = int(call(handle))
                except Exception as exc:  # not every sandbox exposes the link
                    device[key] = f"unavailable: {exc}"
            info["devices"].append(device)
        return info
