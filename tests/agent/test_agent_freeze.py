"""The freeze backend on real processes: SIGSTOP/SIGCONT and its safety refusals."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

from timeslice_agent.backends import (
    BackendError,
    BackendRefused,
    FreezeBackend,
    JobContext,
    SavedJob,
)
from timeslice_agent.procs import identity_of, pid_exists, process_state
from timeslice_proto.timeslice.v1 import WorkerInfo


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, 18)  # SIGCONT, so the kill is delivered at once
            proc.kill()
        proc.wait()


def _ctx(*workers: WorkerInfo, saved_pids: tuple[int, ...] = ()) -> JobContext:
    """The job's context, each pid pinned to the process running it now (as a registration)."""
    pids = {w.pid for w in workers} | set(saved_pids)
    found = (identity_of(p) for p in sorted(pids))
    identities = tuple(i for i in found if i is not None)
    return JobContext("j1", "g1", workers=workers, saved_pids=saved_pids, identities=identities)


def _worker(pid: int, *, acquirer: bool = False) -> WorkerInfo:
    return WorkerInfo(job_id="j1", group_id="g1", pid=pid, acquirer=acquirer)


async def _wait_state(pid: int, states: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        state = process_state(pid)
        if state is not None and state in states:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} state {state!r}, wanted one of {states!r}")
        await asyncio.sleep(0.01)


async def test_freeze_really_stops_and_resumes_a_process(sleeper: subprocess.Popen[bytes]) -> None:
    backend = FreezeBackend()
    ctx = _ctx(_worker(sleeper.pid))
    transfer = await backend.checkpoint(ctx)
    assert transfer.bytes_moved == 0
    assert process_state(sleeper.pid) == "T"
    await backend.restore(ctx)
    assert await _wait_state(sleeper.pid, "SR") in "SR"


async def test_restore_uses_saved_pids_after_a_restart(sleeper: subprocess.Popen[bytes]) -> None:
    backend = FreezeBackend()
    await backend.checkpoint(_ctx(_worker(sleeper.pid)))
    assert await backend.reconcile(SavedJob("j1", "g1", 0, (sleeper.pid,))) is None
    # After an agent restart no worker is registered; the pids of the checkpoint are enough.
    await backend.restore(_ctx(saved_pids=(sleeper.pid,)))
    assert await _wait_state(sleeper.pid, "SR") in "SR"


async def test_refuses_acquirer_and_signals_nothing(sleeper: subprocess.Popen[bytes]) -> None:
    other = subprocess.Popen(["sleep", "30"])
    try:
        ctx = _ctx(_worker(other.pid), _worker(sleeper.pid, acquirer=True))
        with pytest.raises(BackendRefused, match="acquirer"):
            FreezeBackend().admit_checkpoint(ctx)
        with pytest.raises(BackendRefused, match="acquirer"):
            await FreezeBackend().checkpoint(ctx)
        assert process_state(other.pid) in ("S", "R")
        assert process_state(sleeper.pid) in ("S", "R")
    finally:
        other.kill()
        other.wait()


async def test_refuses_own_pid_init_and_dead_pid() -> None:
    backend = FreezeBackend()
    with pytest.raises(BackendRefused, match="agent itself"):
        await backend.checkpoint(_ctx(_worker(os.getpid())))
    with pytest.raises(BackendRefused, match="pid 1"):
        await backend.checkpoint(_ctx(_worker(1)))
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not pid_exists(dead.pid)
    with pytest.raises(BackendRefused, match="no such process"):
        await backend.checkpoint(_ctx(_worker(dead.pid)))
    with pytest.raises(BackendRefused, match="agent itself"):
        await backend.restore(_ctx(_worker(os.getpid())))


async def test_zombie_counts_as_gone() -> None:
    proc = subprocess.Popen(["true"])
    assert await _wait_state(proc.pid, "Z") == "Z"  # exited, not yet reaped
    assert not pid_exists(proc.pid)
    proc.wait()


async def test_restore_of_vanished_process_fails_and_reconcile_notices(
    sleeper: subprocess.Popen[bytes],
) -> None:
    backend = FreezeBackend()
    await backend.checkpoint(_ctx(_worker(sleeper.pid)))
    os.kill(sleeper.pid, 18)
    sleeper.kill()
    sleeper.wait()
    reason = await backend.reconcile(SavedJob("j1", "g1", 0, (sleeper.pid,)))
    assert reason is not None and "vanished" in reason
    with pytest.raises(BackendError, match="vanished while frozen"):
        await backend.restore(_ctx(saved_pids=(sleeper.pid,)))


async def test_failed_freeze_resumes_what_it_stopped(
    sleeper: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The processes are really stopped, but the backend is made to believe they never reach the
    # stopped state: it must give up and resume every process it stopped.
    seen: list[str | None] = []

    def lying_state(pid: int) -> str:
        seen.append(process_state(pid))
        return "R"

    monkeypatch.setattr("timeslice_agent.backends.freeze.process_state", lying_state)
    backend = FreezeBackend(stop_wait=0.05)
    other = subprocess.Popen(["sleep", "30"])
    try:
        with pytest.raises(BackendError, match="did not stop within"):
            await backend.checkpoint(_ctx(_worker(sleeper.pid), _worker(other.pid)))
        monkeypatch.undo()
        assert "T" in seen  # they really were stopped
        for pid in (sleeper.pid, other.pid):
            assert await _wait_state(pid, "SR") in "SR"
    finally:
        other.kill()
        other.wait()


async def test_a_restore_with_a_vanished_rank_resumes_none_of_the_others(
    sleeper: subprocess.Popen[bytes],
) -> None:
    """All or nothing: the job stays parked, as the agent and the orchestrator record it,
    instead of its live ranks running on devices the next job is given."""
    backend = FreezeBackend()
    other = subprocess.Popen(["sleep", "30"])
    try:
        await backend.checkpoint(_ctx(_worker(sleeper.pid), _worker(other.pid)))
        assert await _wait_state(other.pid, "T") == "T"
        os.kill(sleeper.pid, 18)
        sleeper.kill()
        sleeper.wait()
        with pytest.raises(BackendError, match="vanished while frozen; the others stay frozen"):
            await backend.restore(_ctx(saved_pids=(sleeper.pid, other.pid)))
        await asyncio.sleep(0.2)
        assert process_state(other.pid) == "T"
    finally:
        os.kill(other.pid, 18)
        other.kill()
        other.wait()
