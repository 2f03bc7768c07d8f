"""The real ``DriverApi`` and ``CudaBackend`` against a stand-in ``cuda.bindings.driver``.

The stand-in (``fake_cuda_driver``) has the call shapes and return tuples of cuda-bindings 13.5.0
and the driver's per-pid state machine, so these tests see the order in which the real code
calls the driver: dropping the lock step from ``DriverApi.checkpoint_steps`` fails them (the
driver answers the checkpoint of a running process with CUDA_ERROR_ILLEGAL_STATE).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import fake_cuda_driver
import pytest
from fake_cuda_driver import CHECKPOINTED, RUNNING, CUresult, StandInDriver

from timeslice_agent.backends import BackendError, JobContext, SavedJob
from timeslice_agent.backends.cuda import (
    REQUIRED_DRIVER_SYMBOLS,
    CudaBackend,
    CudaUnavailable,
    DriverApi,
    open_driver,
)
from timeslice_agent.config import CudaPath, CudaSettings
from timeslice_proto.timeslice.v1 import WorkerInfo

ROOT = Path(__file__).resolve().parents[2]
PIDS = (2001, 2002, 2003)
LOCK_TIMEOUT_MS = 7_000


@pytest.fixture
def driver(monkeypatch: pytest.MonkeyPatch) -> Iterator[StandInDriver]:
    """A stand-in driver that ``from cuda.bindings import driver`` imports during the test."""
    stand_in = StandInDriver()
    for name, module in fake_cuda_driver.modules(stand_in).items():
        monkeypatch.setitem(sys.modules, name, module)
    yield stand_in


async def unchecked(job: JobContext, pids: tuple[int, ...]) -> None:
    """The pids are invented: the identity check is tested on real processes elsewhere."""


def backend() -> CudaBackend:
    api = open_driver(CudaSettings(path=CudaPath.DRIVER))
    assert isinstance(api, DriverApi)
    return CudaBackend(api, lock_timeout_ms=LOCK_TIMEOUT_MS, targets=unchecked)


def job(pids: Sequence[int] = PIDS, saved: Sequence[int] | None = None) -> JobContext:
    workers = tuple(WorkerInfo(job_id="j1", group_id="g1", pid=p) for p in pids)
    saved_pids = tuple(pids if saved is None else saved)
    return JobContext("j1", "g1", workers=workers, saved_pids=saved_pids)


def first_and_last(driver: StandInDriver, name: str) -> tuple[int, int]:
    """Where the calls of ``name`` begin and end in the driver's record."""
    at = [i for i, (called, _) in enumerate(driver.calls) if called == name]
    return at[0], at[-1]


async def test_checkpoint_locks_every_pid_then_checkpoints_every_pid(
    driver: StandInDriver,
) -> None:
    transfer = await backend().checkpoint(job())
    assert transfer.moved_pids == PIDS
    for pid in PIDS:
        assert driver.calls_of(pid) == ["GetState", "Lock", "Checkpoint"]
        assert driver.state(pid) is CHECKPOINTED
        assert driver.lock_timeouts[pid] == [LOCK_TIMEOUT_MS]
    # No rank is checkpointed while another still runs.
    _, last_lock = first_and_last(driver, "cuCheckpointProcessLock")
    first_checkpoint, _ = first_and_last(driver, "cuCheckpointProcessCheckpoint")
    assert last_lock < first_checkpoint


async def test_restore_restores_every_pid_then_unlocks_every_pid(driver: StandInDriver) -> None:
    cuda = backend()
    await cuda.checkpoint(job())
    driver.calls.clear()
    await cuda.restore(job())
    for pid in PIDS:
        assert driver.calls_of(pid) == ["Restore", "Unlock"]
        assert driver.state(pid) is RUNNING
    _, last_restore = first_and_last(driver, "cuCheckpointProcessRestore")
    first_unlock, _ = first_and_last(driver, "cuCheckpointProcessUnlock")
    assert last_restore < first_unlock


async def test_a_failed_checkpoint_puts_every_pid_back_to_running(driver: StandInDriver) -> None:
    driver.errors["cuCheckpointProcessCheckpoint", 2002] = CUresult.CUDA_ERROR_OPERATING_SYSTEM
    with pytest.raises(BackendError) as info:
        await backend().checkpoint(job())
    reason = info.value.reason
    assert "step checkpoint for pid 2002: CUDA_ERROR_OPERATING_SYSTEM" in reason
    assert "rolled back pids [2001, 2002, 2003]" in reason and "[driver-api]" in reason
    assert driver.calls_of(2001) == ["GetState", "Lock", "Checkpoint", "Restore", "Unlock"]
    assert driver.calls_of(2002) == ["GetState", "Lock", "Checkpoint", "Unlock"]
    assert all(driver.state(p) is RUNNING for p in PIDS)


async def test_a_process_without_cuda_is_left_alone(driver: StandInDriver) -> None:
    # The driver answers CUDA_ERROR_NOT_INITIALIZED for a process that never initialised CUDA
    # (the job's acquirer, a helper): it has nothing to move, and the rest of the job moves.
    driver.no_cuda.add(2002)
    cuda = backend()
    transfer = await cuda.checkpoint(job())
    assert transfer.moved_pids == (2001, 2003)
    assert driver.calls_of(2002) == ["GetState"]
    await cuda.restore(job(saved=transfer.moved_pids))
    assert driver.calls_of(2002) == ["GetState"]
    assert all(driver.state(p) is RUNNING for p in PIDS)


@pytest.mark.parametrize(
    "error",
    [
        CUresult.CUDA_ERROR_NOT_SUPPORTED,
        CUresult.CUDA_ERROR_NOT_FOUND,
        CUresult.CUDA_ERROR_INVALID_VALUE,
    ],
)
async def test_any_other_get_state_error_fails_the_directive_naming_it(
    driver: StandInDriver, error: CUresult
) -> None:
    # A refused API must say so at once, not as "the checkpoint freed no memory" from NVML.
    driver.errors["cuCheckpointProcessGetState", 2003] = error
    with pytest.raises(BackendError) as info:
        await backend().checkpoint(job())
    reason = info.value.reason
    assert f"step get-state for pid 2003: {error.name}" in reason
    assert "no pid had moved" in reason
    assert [name for name, _ in driver.calls] == ["cuCheckpointProcessGetState"] * 3


async def test_reconcile_reads_the_driver_state_of_every_saved_pid(
    driver: StandInDriver,
) -> None:
    cuda = backend()
    await cuda.checkpoint(job(pids=(2001,)))
    assert await cuda.reconcile(SavedJob("j1", "g1", 1, (2001,))) is None
    assert await cuda.reconcile(SavedJob("j1", "g1", 1, (2001, 2002))) == (
        "pid 2002 is running, not checkpointed"
    )


async def test_restore_thread_id_uses_the_value_of_the_return_tuple(
    driver: StandInDriver,
) -> None:
    api = DriverApi()
    assert await api.restore_thread_id(2001) == 2001  # the stand-in answers the pid itself
    assert api.bindings_version == "13.5.0"


@pytest.mark.parametrize("symbol", REQUIRED_DRIVER_SYMBOLS)
def test_a_bindings_release_without_a_checkpoint_symbol_is_refused_naming_its_version(
    monkeypatch: pytest.MonkeyPatch, symbol: str
) -> None:
    name, _, member = symbol.partition(".")
    stand_in = StandInDriver()
    modules = fake_cuda_driver.modules(stand_in, version="13.3.0", missing=[] if member else [name])
    if member:  # an enum without one member: a plain namespace lacking it
        enum_class = getattr(modules["cuda.bindings.driver"], name)
        kept = {m.name: m for m in enum_class if m.name != member}
        monkeypatch.setattr(modules["cuda.bindings.driver"], name, type(name, (), kept))
    for key, module in modules.items():
        monkeypatch.setitem(sys.modules, key, module)
    with pytest.raises(CudaUnavailable) as info:
        DriverApi()
    message = str(info.value)
    assert message.startswith("cuda-bindings 13.3.0 lacks the driver checkpoint API")
    assert symbol in message
    assert stand_in.calls == []  # refused before any call, cuInit included


def test_the_stand_in_matches_the_installed_cuda_bindings() -> None:
    # Where the real package is installed (the dev extras install it), the stand-in's names,
    # codes and states must be its own: a drifted stand-in would test a driver that is not there.
    real = pytest.importorskip("cuda.bindings.driver")
    assert [name for name in fake_cuda_driver.SYMBOLS if not hasattr(real, name)] == []
    for enum_class in (fake_cuda_driver.CUresult, fake_cuda_driver.CUprocessState):
        real_enum = getattr(real, enum_class.__name__)
        assert {m.name: int(getattr(real_enum, m.name)) for m in enum_class} == {
            m.name: m.value for m in enum_class
        }
    lock_args = real.CUcheckpointLockArgs()
    lock_args.timeoutMs = 5  # the one field DriverApi sets
    assert lock_args.timeoutMs == 5


CHILD = """
import sys
sys.path.insert(0, {tests!r})
import fake_cuda_driver
stand_in = fake_cuda_driver.StandInDriver()
sys.modules.update(
    fake_cuda_driver.modules(stand_in, version="13.3.0", missing=["CUcheckpointRestoreArgs"])
)
from timeslice_agent.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("path", ["driver", "auto"])
def test_agent_refuses_to_start_with_one_line_naming_the_bindings_version(
    tmp_path: Path, path: str
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
    env["PATH"] = "/usr/bin:/bin"  # no cuda-checkpoint to fall back to
    argv = [
        sys.executable, "-c", CHILD.format(tests=str(Path(__file__).parent)),
        "--orchestrator", "127.0.0.1:1", "--backend", "cuda", "--cuda-path", path,
        "--worker-socket", str(tmp_path / "a.sock"), "--insecure",
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("timeslice-agent: cannot start the cuda backend: ")
    assert (
        "cuda-bindings 13.3.0 lacks the driver checkpoint API (CUcheckpointRestoreArgs)"
        in (lines[0])
    )
    assert not (tmp_path / "a.sock").exists()
