"""The sim backend (an emulation): modelled transfer time and device-capacity admission."""

from __future__ import annotations

import asyncio
import time

import pytest

from timeslice_agent.backends import BackendRefused, JobContext, ResidentJob, SavedJob, SimBackend
from timeslice_agent.config import GB, SimSettings
from timeslice_proto.timeslice.v1 import WorkerInfo


def _sim(
    capacity_gb: float = 80, bandwidth_gbps: float = 50, state_gb: float = 40, scale: float = 1.0
) -> SimBackend:
    return SimBackend(
        SimSettings(
            capacity_bytes=int(capacity_gb * GB),
            bandwidth_bytes_per_s=bandwidth_gbps * GB,
            default_state_bytes=int(state_gb * GB),
            time_scale=scale,
        )
    )


def _ctx(job: str, state_bytes: int = 0, resident: tuple[ResidentJob, ...] = ()) -> JobContext:
    worker = WorkerInfo(job_id=job, group_id="g", pid=1234, state_bytes=state_bytes)
    return JobContext(job, "g", workers=(worker,), state_bytes=state_bytes, resident=resident)


async def test_transfer_time_is_bytes_over_bandwidth() -> None:
    sim = _sim(bandwidth_gbps=10, scale=1.0)
    ctx = _ctx("j1", state_bytes=int(2 * GB))  # 2 GB at 10 GB/s: 0.2 s each way
    started = time.monotonic()
    transfer = await sim.checkpoint(ctx)
    took = time.monotonic() - started
    assert transfer.bytes_moved == 2 * GB
    assert 0.18 <= took < 1.0
    assert 0.18 <= transfer.elapsed_seconds < 1.0
    assert sim.host_bytes == 2 * GB
    started = time.monotonic()
    back = await sim.restore(ctx)
    assert back.bytes_moved == 2 * GB
    assert 0.18 <= time.monotonic() - started < 1.0
    assert sim.host_bytes == 0


async def test_time_scale_and_default_state_size() -> None:
    sim = _sim(bandwidth_gbps=50, state_gb=40, scale=0.0)
    transfer = await sim.checkpoint(_ctx("j1", state_bytes=0))
    assert transfer.bytes_moved == 40 * GB
    assert transfer.elapsed_seconds < 0.5  # scale 1 would take 0.8 s
    assert sim.transfer_seconds(50 * GB) == 0.0
    assert _sim(bandwidth_gbps=50, scale=2.0).transfer_seconds(50 * GB) == pytest.approx(2.0)


async def test_restore_refused_when_it_does_not_fit() -> None:
    sim = _sim(capacity_gb=80, scale=0.0)
    ctx = _ctx("j1", state_bytes=int(50 * GB))
    await sim.checkpoint(ctx)
    crowded = _ctx("j1", state_bytes=int(50 * GB), resident=(ResidentJob("j2", int(40 * GB)),))
    with pytest.raises(BackendRefused, match=r"insufficient device memory: need 50000000000 bytes"):
        sim.admit_restore(crowded)
    with pytest.raises(BackendRefused, match=r"free 40000000000 bytes"):
        await sim.restore(crowded)
    # Nothing moved: the job is still parked on the host.
    assert sim.host_bytes == 50 * GB
    # A resident job that announced 0 bytes counts with the default state size (40 GB).
    with pytest.raises(BackendRefused):
        await sim.restore(_ctx("j1", int(50 * GB), resident=(ResidentJob("j2", 0),)))
    roomy = _ctx("j1", state_bytes=int(50 * GB), resident=(ResidentJob("j2", int(30 * GB)),))
    assert (await sim.restore(roomy)).bytes_moved == 50 * GB


async def test_concurrent_restores_cannot_overcommit() -> None:
    sim = _sim(capacity_gb=80, bandwidth_gbps=100, scale=1.0)
    a, b = _ctx("a", int(50 * GB)), _ctx("b", int(50 * GB))
    await asyncio.gather(sim.checkpoint(a), sim.checkpoint(b))
    first = asyncio.create_task(sim.restore(a))
    await asyncio.sleep(0.05)  # a's 0.5 s restore is in flight and holds its 50 GB
    with pytest.raises(BackendRefused, match="insufficient device memory"):
        await sim.restore(b)
    assert (await first).bytes_moved == 50 * GB


async def test_cancelled_checkpoint_moves_nothing() -> None:
    sim = _sim(bandwidth_gbps=1, scale=1.0)
    task = asyncio.create_task(sim.checkpoint(_ctx("j1", int(10 * GB))))
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sim.host_bytes == 0


async def test_reconcile_recreates_host_books_and_devices_are_labelled() -> None:
    sim = _sim(capacity_gb=80, scale=0.0)
    assert await sim.reconcile(SavedJob("j1", "g", 7 * GB, ())) is None
    assert sim.host_bytes == 7 * GB
    assert (await sim.restore(_ctx("j1", 0))).bytes_moved == 7 * GB
    (device,) = sim.devices([])
    assert device.name == "sim-device (emulated)"
    assert device.memory_bytes == 80 * GB
    assert sim.emulated is True and sim.name == "sim"
