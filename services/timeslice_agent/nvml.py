"""Device discovery through NVML (package nvidia-ml-py, import name ``pynvml``).

Discovery is best effort: without a driver (CI, the sim backend on a laptop) it returns no
devices and says why in the log.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from timeslice_proto.timeslice.v1 import Device

log = logging.getLogger(__name__)


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
        return await asyncio.wait_for(asyncio.to_thread(_discover_blocking), timeout)
    except TimeoutError:
        log.warning("nvml: discovery took longer than %g s; no devices discovered", timeout)
        return []
