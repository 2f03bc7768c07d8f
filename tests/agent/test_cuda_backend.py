"""The cuda backend's step logic, behind the narrow driver interface.

A recording fake plays the driver here: these tests prove the ordering (lock every pid, then
checkpoint every pid; restore every pid, then unlock every pid), the rollback of what already
moved when one pid fails, deadlines and the error message. They prove the logic only: the
real ``DriverApi`` runs against a stand-in ``cuda.bindings.driver`` in test_cuda_driver_api.py,
and against the driver itself in ``scripts/gpu-check`` on a GPU machine.

The ``cli`` path is run for real against an executable standing in for ``cuda-checkpoint``
(same flags, state kept in files), and ``timeslice agent --backend cuda`` is started for real
on this machine, which has no NVIDIA driver.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from timeslice_agent.backends import BackendError, BackendRefused, JobContext, SavedJob
from timeslice_agent.backends.cuda import (
    CheckpointCli,
    CudaBackend,
    CudaCallError,
    CudaUnavailable,
    NoCudaState,
    ProcessState,
    Step,
    open_driver,
)
from timeslice_agent.config import CudaPath, CudaSettings
from timeslice_proto.timeslice.v1 import WorkerInfo

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FakeDriver:
    """Records every call as (step, pid); fails or hangs where told; tracks process states."""

    mechanism: str = "driver-api"
    calls: list[tuple[str, int]] = field(default_factory=list)
    fail: dict[tuple[str, int], str] = field(default_factory=dict)
    no_cuda: set[int] = field(default_factory=set)
    hang: set[tuple[str, int]] = field(default_factory=set)
    hang_seconds: float = 0.3
    states: dict[int, ProcessState] = field(default_factory=dict)

    async def _call(self, step: str, pid: int, new_state: ProcessState) -> None:
        self.calls.append((step, pid))
        # Let every pid's call start before any finishes, as threads would.
        await asyncio.sleep(0.01)
        if (step, pid) in self.hang:
            await asyncio.sleep(self.hang_seconds)
        error = self.fail.get((step, pid))
        if error is not None:
            raise CudaCallError(step, pid, error)
        self.states[pid] = new_state

    async def lock(self, pid: int) -> None:
        await self._call("lock", pid, ProcessState.LOCKED)

    async def checkpoint(self, pid: int) -> None:
        await self._call("checkpoint", pid, ProcessState.CHECKPOINTED)

    async def restore(self, pid: int) -> None:
        await self._call("restore", pid, ProcessState.LOCKED)

    async def unlock(self, pid: int) -> None:
        await self._call("unlock", pid, ProcessState.RUNNING)

    def checkpoint_steps(self, lock_timeout_ms: int) -> Sequence[Step]:
        return (
            Step("lock", self.lock, self.unlock),
            Step("checkpoint", self.checkpoint, self.restore),
        )

    def restore_steps(self, lock_timeout_ms: int) -> Sequence[Step]:
        return (
            Step("restore", self.restore, self.checkpoint),
            Step("unlock", self.unlock, self.lock),
        )

    async def state(self, pid: int) -> ProcessState:
        if pid in self.no_cuda:
            raise NoCudaState("get-state", pid, "CUDA_ERROR_NOT_INITIALIZED")
        return self.states.get(pid, ProcessState.RUNNING)


PIDS = (1001, 1002, 1003)


async def unchecked(job: JobContext, pids: tuple[int, ...]) -> None:
    """These tests drive the step logic with invented pids, so the check that a pid is still
    the registered process is left out here; test_agent_peers.py tests it on real processes."""


def job(
    pids: Sequence[int] = PIDS, state_bytes: int = 3 << 30, saved: Sequence[int] | None = None
) -> JobContext:
    """A job of ``pids``; ``saved``: the pids its last checkpoint moved (default: all)."""
    workers = tuple(WorkerInfo(job_id="j1", group_id="g1", pid=p) for p in pids)
    return JobContext(
        job_id="j1",
        group_id="g1",
        workers=workers,
        state_bytes=state_bytes,
        saved_pids=tuple(pids if saved is None else saved),
    )


def steps_of(calls: list[tuple[str, int]]) -> list[str]:
    """The order in which steps were entered (consecutive calls of one step merged)."""
    order: list[str] = []
    for step, _ in calls:
        if not order or order[-1] != step:
            order.append(step)
    return order


async def test_checkpoint_locks_every_pid_before_checkpointing_any() -> None:
    driver = FakeDriver()
    backend = CudaBackend(driver, targets=unchecked)
    transfer = await backend.checkpoint(job())
    assert steps_of(driver.calls) == ["lock", "checkpoint"]
    assert sorted(driver.calls[:3]) == [("lock", p) for p in PIDS]
    assert sorted(driver.calls[3:]) == [("checkpoint", p) for p in PIDS]
    assert all(driver.states[p] is ProcessState.CHECKPOINTED for p in PIDS)
    assert transfer.bytes_moved == 3 << 30  # NVML replaces it when present (executor)
    assert backend.mechanism == "driver-api"


async def test_restore_restores_every_pid_before_unlocking_any() -> None:
    driver = FakeDriver()
    backend = CudaBackend(driver, targets=unchecked)
    await backend.checkpoint(job())
    driver.calls.clear()
    await backend.restore(job())
    assert steps_of(driver.calls) == ["restore", "unlock"]
    assert all(driver.states[p] is ProcessState.RUNNING for p in PIDS)


async def test_checkpoint_leaves_processes_without_cuda_state_alone() -> None:
    # The acquirer (or any helper process) of a job has no CUDA context: locking it would
    # fail the whole job, so it is not moved, and the restore brings back only what moved.
    driver = FakeDriver(no_cuda={1002})
    backend = CudaBackend(driver, targets=unchecked)
    transfer = await backend.checkpoint(job())
    assert transfer.moved_pids == (1001, 1003)
    assert {pid for _, pid in driver.calls} == {1001, 1003}
    driver.calls.clear()
    # A process that joined the job while it was parked is running: it is not "restored".
    await backend.restore(job(pids=(*PIDS, 1004), saved=transfer.moved_pids))
    assert {pid for _, pid in driver.calls} == {1001, 1003}


async def test_steps_run_concurrently_across_pids() -> None:
    driver = FakeDriver(hang={("lock", p) for p in PIDS}, hang_seconds=1.0)
    started = asyncio.get_running_loop().time()
    await CudaBackend(driver, targets=unchecked).checkpoint(job())
    # Three 1 s locks one after another would take 3 s.
    assert asyncio.get_running_loop().time() - started < 2.5


async def test_failed_checkpoint_rolls_back_every_pid_and_names_pid_error_and_step() -> None:
    driver = FakeDriver(fail={("checkpoint", 1002): "CUDA_ERROR_ILLEGAL_STATE"})
    with pytest.raises(BackendError) as info:
        await CudaBackend(driver, targets=unchecked).checkpoint(job())
    reason = info.value.reason
    assert "step checkpoint" in reason and "pid 1002" in reason
    assert "CUDA_ERROR_ILLEGAL_STATE" in reason and "[driver-api]" in reason
    assert "rolled back pids [1001, 1002, 1003]" in reason
    # The two pids that checkpointed were restored, then every locked pid unlocked.
    rollback = driver.calls[6:]
    assert sorted(rollback[:2]) == [("restore", 1001), ("restore", 1003)]
    assert sorted(rollback[2:]) == [("unlock", p) for p in PIDS]
    assert all(driver.states[p] is ProcessState.RUNNING for p in PIDS)


async def test_failed_lock_unlocks_only_what_was_locked() -> None:
    driver = FakeDriver(fail={("lock", 1003): "CUDA_ERROR_NOT_READY"})
    with pytest.raises(BackendError, match=r"step lock for pid 1003: CUDA_ERROR_NOT_READY"):
        await CudaBackend(driver, targets=unchecked).checkpoint(job())
    assert ("checkpoint", 1001) not in driver.calls
    unlocked = sorted(c for c in driver.calls if c[0] == "unlock")
    assert unlocked == [("unlock", 1001), ("unlock", 1002)]


async def test_failed_unlock_on_restore_puts_every_pid_back_to_checkpointed() -> None:
    driver = FakeDriver()
    backend = CudaBackend(driver, targets=unchecked)
    await backend.checkpoint(job())
    driver.fail[("unlock", 1001)] = "CUDA_ERROR_UNKNOWN"
    driver.calls.clear()
    with pytest.raises(BackendError, match="step unlock for pid 1001"):
        await backend.restore(job())
    # 1002 and 1003 ran again for a moment: they are locked again and checkpointed again.
    assert all(driver.states[p] is ProcessState.CHECKPOINTED for p in (1002, 1003))
    undo = driver.calls[6:]
    assert sorted(undo[:2]) == [("lock", 1002), ("lock", 1003)]
    assert sorted(undo[2:]) == [("checkpoint", p) for p in PIDS]


async def test_deadline_waits_for_calls_in_flight_then_rolls_back() -> None:
    driver = FakeDriver(hang={("checkpoint", 1002)}, hang_seconds=0.4)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.15):
            await CudaBackend(driver, targets=unchecked).checkpoint(job())
    # The hung call was allowed to finish (a driver call cannot be interrupted), then all
    # three were restored and unlocked: nothing is left checkpointed or locked.
    assert all(driver.states[p] is ProcessState.RUNNING for p in PIDS)
    assert sorted(c for c in driver.calls if c[0] == "restore") == [("restore", p) for p in PIDS]


async def test_rollback_finishes_even_when_cancelled_again_and_again() -> None:
    # Shutdown cancels running directives, then the event loop's teardown cancels again:
    # neither may cut the rollback short and leave a rank locked or checkpointed.
    driver = FakeDriver(hang={("checkpoint", 1002), ("restore", 1001)}, hang_seconds=0.3)
    task = asyncio.ensure_future(CudaBackend(driver, targets=unchecked).checkpoint(job()))
    await asyncio.sleep(0.1)
    for _ in range(3):
        task.cancel()
        await asyncio.sleep(0.15)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(driver.states[p] is ProcessState.RUNNING for p in PIDS), driver.states


async def test_refuses_the_agent_itself_and_pid_1() -> None:
    backend = CudaBackend(FakeDriver(), targets=unchecked)
    with pytest.raises(BackendRefused, match="pid 1"):
        backend.admit_checkpoint(job(pids=(1, 1001)))
    with pytest.raises(BackendRefused, match=f"pid {os.getpid()}"):
        backend.admit_restore(job(pids=(os.getpid(),)))


async def test_reconcile_checks_every_saved_pid_is_still_checkpointed() -> None:
    driver = FakeDriver(states={1001: ProcessState.CHECKPOINTED, 1002: ProcessState.RUNNING})
    backend = CudaBackend(driver, targets=unchecked)
    assert await backend.reconcile(SavedJob("j1", "g1", 1, (1001,))) is None
    reason = await backend.reconcile(SavedJob("j1", "g1", 1, (1001, 1002)))
    assert reason == "pid 1002 is running, not checkpointed"


# ----- the cuda-checkpoint binary path, for real ---------------------------------------------

FAKE_CLI = """#!/bin/sh
# Stands in for cuda-checkpoint: --get-state / --toggle on a per-pid state file.
set -e
dir="$FAKE_CUDA_CHECKPOINT_DIR"
action="$1"; pid="$3"
state=$(cat "$dir/$pid" 2>/dev/null || echo running)
if [ -e "$dir/fail-$pid" ] && [ "$action" = --toggle ]; then
  echo "Could not toggle: CUDA_ERROR_NOT_SUPPORTED" >&2; exit 1
fi
if [ -e "$dir/state-error-$pid" ]; then
  echo "Could not get state: \"$(cat "$dir/state-error-$pid")\"" >&2; exit 1
fi
case "$action" in
  --get-state) echo "$state" ;;
  --toggle)
    echo "toggle $pid" >> "$dir/log"
    next=running; [ "$state" = running ] && next=checkpointed
    echo "$next" > "$dir/$pid" ;;
  *) echo "unknown $action" >&2; exit 2 ;;
esac
"""


@pytest.fixture
def fake_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    binary = bindir / "cuda-checkpoint"
    binary.write_text(FAKE_CLI)
    binary.chmod(0o755)
    state = tmp_path / "cli-state"
    state.mkdir()
    monkeypatch.setenv("FAKE_CUDA_CHECKPOINT_DIR", str(state))
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    return state


async def test_cli_path_toggles_each_pid_and_is_idempotent(fake_cli: Path) -> None:
    driver = open_driver(CudaSettings(path=CudaPath.CLI))
    assert isinstance(driver, CheckpointCli) and driver.mechanism == "cli"
    backend = CudaBackend(driver, targets=unchecked)
    await backend.checkpoint(job(pids=(11, 12)))
    assert {(fake_cli / p).read_text().strip() for p in ("11", "12")} == {"checkpointed"}
    # A checkpoint retried on checkpointed processes must not toggle them back.
    await backend.checkpoint(job(pids=(11, 12)))
    assert (fake_cli / "log").read_text().count("toggle") == 2
    assert await backend.reconcile(SavedJob("j1", "g1", 0, (11, 12))) is None
    await backend.restore(job(pids=(11, 12)))
    assert {(fake_cli / p).read_text().strip() for p in ("11", "12")} == {"running"}


async def test_cli_failure_rolls_back_the_others_and_reports_the_tool_message(
    fake_cli: Path,
) -> None:
    (fake_cli / "fail-13").touch()
    with pytest.raises(BackendError) as info:
        await CudaBackend(
            open_driver(CudaSettings(path=CudaPath.CLI)), targets=unchecked
        ).checkpoint(job(pids=(11, 13)))
    assert "pid 13" in info.value.reason and "CUDA_ERROR_NOT_SUPPORTED" in info.value.reason
    assert "[cli]" in info.value.reason
    assert (fake_cli / "11").read_text().strip() == "running"


async def test_cli_leaves_a_process_without_cuda_alone_and_fails_on_other_errors(
    fake_cli: Path,
) -> None:
    # The binary prints cuGetErrorString's text: "initialization error" is NOT_INITIALIZED.
    (fake_cli / "state-error-12").write_text("initialization error")
    backend = CudaBackend(open_driver(CudaSettings(path=CudaPath.CLI)), targets=unchecked)
    transfer = await backend.checkpoint(job(pids=(11, 12)))
    assert transfer.moved_pids == (11,)
    (fake_cli / "state-error-13").write_text("operation not supported")
    with pytest.raises(BackendError, match=r"step get-state for pid 13: .*operation not supported"):
        await backend.checkpoint(job(pids=(13,)))


def test_auto_falls_back_to_the_cli_only_when_it_is_on_path(fake_cli: Path) -> None:
    # No NVIDIA driver here: auto takes the binary; driver-only refuses with the reason.
    assert open_driver(CudaSettings(path=CudaPath.AUTO)).mechanism == "cli"
    with pytest.raises(CudaUnavailable, match=r"libcuda\.so\.1 not found"):
        open_driver(CudaSettings(path=CudaPath.DRIVER))


def test_agent_with_cuda_backend_exits_2_with_one_line_and_no_fallback(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
    env["PATH"] = "/usr/bin:/bin"  # no cuda-checkpoint either
    argv = [
        str(Path(sys.executable).with_name("timeslice")), "agent", "--orchestrator", "127.0.0.1:1",
        "--backend", "cuda", "--worker-socket", str(tmp_path / "a.sock"), "--insecure",
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "cuda backend" in lines[0] and "libcuda.so.1 not found" in lines[0]
    assert "cuda-checkpoint not found on PATH" in lines[0]
    assert not (tmp_path / "a.sock").exists()  # it never started serving
