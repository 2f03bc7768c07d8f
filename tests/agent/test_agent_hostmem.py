"""Host-memory admission: a checkpoint that would not fit in host memory is refused up front."""

from __future__ import annotations

from pathlib import Path

from timeslice_agent.hostmem import GB, HostMemory, mem_available


def test_mem_available_reads_the_kernels_figure(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1000 kB\nMemFree:  10 kB\nMemAvailable:  2048 kB\n")
    assert mem_available(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal:  1000 kB\n")
    assert mem_available(meminfo) == 0


def test_the_live_machine_has_some_memory_available() -> None:
    assert mem_available() > 0


def test_a_modelled_host_counts_what_is_parked() -> None:
    host = HostMemory(reserve_bytes=1 * GB, modelled_bytes=10 * GB)
    assert host.available(parked_bytes=4 * GB) == 6 * GB
    assert host.refusal(needed_bytes=5 * GB, parked_bytes=4 * GB) is None  # 5 + 1 <= 6
    reason = host.refusal(needed_bytes=5 * GB + 1, parked_bytes=4 * GB)
    assert reason is not None
    assert "needs 5.00 GB" in reason and "6.00 GB" in reason and "1.00 GB is reserved" in reason


def test_nothing_to_park_is_never_refused() -> None:
    host = HostMemory(reserve_bytes=100 * GB, modelled_bytes=1)
    assert host.refusal(needed_bytes=0, parked_bytes=0) is None


def test_the_real_host_refuses_what_it_cannot_hold() -> None:
    host = HostMemory(reserve_bytes=0)
    assert host.refusal(needed_bytes=1, parked_bytes=0) is None
    assert host.refusal(needed_bytes=10**15, parked_bytes=0) is not None  # a petabyte
