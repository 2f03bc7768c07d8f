"""Device-memory checks around real moves, with NVML faked at its boundary."""

from __future__ import annotations

from collections.abc import Collection

import pytest

from timeslice_agent.backends.base import BackendError, BackendRefused
from timeslice_agent.devmem import MemoryCheck


class FakeDevices:
    """Device memory as NVML would report it: ``held`` drains by ``drain`` per poll."""

    def __init__(self, held: int, free: int = 0, drain: int = 0) -> None:
        self.held = held
        self.free = free
        self.drain = drain
        self.polls = 0

    async def held_by(self, pids: Collection[int]) -> int:
        self.polls += 1
        now = self.held
        self.held = max(0, self.held - self.drain)
        return now

    async def free_bytes(self) -> int:
        return self.free

    async def compute_pids(self) -> set[int]:
        return set()

    def close(self) -> None:
        pass


async def test_release_is_confirmed_once_memory_drains() -> None:
    devices = FakeDevices(held=300, drain=100)
    check = MemoryCheck(devices, release_wait=5.0)
    assert await check.confirm_released("job-a", {11}) == 0
    assert devices.polls == 4  # 300, 200, 100, 0


async def test_the_residual_per_process_is_allowed() -> None:
    check = MemoryCheck(FakeDevices(held=500), release_wait=0.2, residual_per_process=256)
    assert await check.confirm_released("job-a", {1, 2}) == 500


async def test_memory_still_held_after_the_wait_fails_the_checkpoint() -> None:
    check = MemoryCheck(FakeDevices(held=64 * 1024 * 1024), release_wait=0.1)
    with pytest.raises(BackendError, match=r"job-a did not free.*\[3, 7\].*64 MiB.*0.1 s"):
        await check.confirm_released("job-a", {7, 3})


async def test_no_pids_means_nothing_to_wait_for() -> None:
    devices = FakeDevices(held=10**9)
    check = MemoryCheck(devices)
    assert await check.confirm_released("job-a", set()) == 0
    assert await check.measure(set()) == 0
    assert devices.polls == 0


async def test_a_restore_that_does_not_fit_is_refused_with_both_numbers() -> None:
    check = MemoryCheck(FakeDevices(held=0, free=1024 * 1024))
    await check.admit_restore("job-b", 1024 * 1024)
    await check.admit_restore("job-b", 0)
    with pytest.raises(BackendRefused, match=r"needs 2097152 bytes .*1048576 bytes .* free"):
        await check.admit_restore("job-b", 2 * 1024 * 1024)
