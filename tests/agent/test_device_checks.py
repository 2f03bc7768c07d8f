"""NVML checks around real moves, the app backend, and process discovery by environment.

The executor runs for real (registry, state file, hooks); only NVML is replaced, by a fake
:class:`DeviceMemory` at that true boundary (no GPU here). Discovery and the foreign-process
guard run against real labelled processes in procfs, and the last test starts a real agent
process that finds and freezes a process nobody registered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import time
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from agent_harness import AgentFactory, FakeHub, directive, eventually
from test_agent_executor import CKPT, REST, Rig, _answer

from timeslice.errors import PermissionDenied
from timeslice_agent.backends import AppBackend
from timeslice_agent.devmem import MemoryCheck
from timeslice_agent.discovery import ProcessFinder, foreign_pids, labels_of
from timeslice_agent.jobs import JobState
from timeslice_agent.procs import identity_of, process_state
from timeslice_proto.timeslice.v1 import AckStatus, HookKind, WorkerInfo
from timeslice_proto.timeslice.v1 import JobState as ProtoJobState

GIB = 1 << 30
MIB = 1 << 20


@dataclass
class FakeDeviceMemory:
    """What NVML would say: bytes per pid and free bytes, changed by the test."""

    held: dict[int, int] = field(default_factory=dict)
    free: int = 80 * GIB
    queries: int = 0

    async def held_by(self, pids: Collection[int]) -> int:
        self.queries += 1
        return sum(self.held.get(p, 0) for p in pids)

    async def free_bytes(self) -> int:
        return self.free

    async def compute_pids(self) -> set[int]:
        return set(self.held)

    def close(self) -> None:
        return None


PID = os.getpid()


@pytest.fixture
async def app_rig(tmp_path: Path):  # type: ignore[no-untyped-def]
    rig = Rig(tmp_path, backend=AppBackend(residual_bytes_per_process=512 * MIB))
    memory = FakeDeviceMemory(held={PID: 6 * GIB})
    rig.executor.memory_check = MemoryCheck(
        memory, release_wait=0.5, residual_per_process=512 * MIB
    )
    rig.memory = memory  # type: ignore[attr-defined]
    yield rig
    await rig.close()


async def _release_then_answer(rig: Rig, memory: FakeDeviceMemory, left: int, lag: float) -> None:
    """The worker's hook: answer at once, but free the memory only ``lag`` seconds later,
    as inference engines do."""
    reg = next(iter(rig.registry._registrations.values()))
    await _answer(reg, rig, HookKind.BEFORE_CHECKPOINT, True, 1234)
    await asyncio.sleep(lag)
    memory.held[PID] = left


async def test_app_checkpoint_reports_nvml_bytes_and_waits_for_a_late_release(
    app_rig: Rig,
) -> None:
    memory: FakeDeviceMemory = app_rig.memory  # type: ignore[attr-defined]
    app_rig.worker("j1", gb=1.0, app_callbacks=True)
    hook = asyncio.create_task(_release_then_answer(app_rig, memory, 300 * MIB, lag=0.2))
    ack = await app_rig.run("d1", CKPT, "j1", 1)
    await hook
    assert ack.status == AckStatus.OK, ack.error
    # NVML's measurement of what left the device: not the announced 1 GB, not the hook's 1234.
    assert ack.bytes_moved == 6 * GIB - 300 * MIB
    assert app_rig.executor.jobs["j1"].saved_bytes == 6 * GIB - 300 * MIB
    assert memory.queries >= 3  # it polled while the engine was still releasing


async def test_checkpoint_that_does_not_free_memory_fails_with_the_numbers(app_rig: Rig) -> None:
    memory: FakeDeviceMemory = app_rig.memory  # type: ignore[attr-defined]
    reg = app_rig.worker("j1", gb=1.0, app_callbacks=True)
    hook = asyncio.create_task(_answer(reg, app_rig, HookKind.BEFORE_CHECKPOINT, True, 5))
    ack = await app_rig.run("d1", CKPT, "j1", 1)
    await hook
    assert ack.status == AckStatus.FAILED
    assert "did not free device memory" in ack.error and f"pids [{PID}]" in ack.error
    assert "6442450944 bytes" in ack.error and "allowed 536870912 bytes" in ack.error
    assert ack.job_state == ProtoJobState.FAULTED
    # The rollback restore re-runs the app's restore hooks on the job still on the device.
    answer = asyncio.create_task(_answer(reg, app_rig, HookKind.AFTER_RESTORE, True, 5))
    ack = await app_rig.run("d2", REST, "j1", 1)
    await answer
    assert (ack.status, ack.job_state) == (AckStatus.OK, ProtoJobState.RUNNING)
    assert memory.held[PID] == 6 * GIB


async def test_restore_without_room_is_refused_with_both_numbers_and_moves_nothing(
    app_rig: Rig,
) -> None:
    memory: FakeDeviceMemory = app_rig.memory  # type: ignore[attr-defined]
    reg = app_rig.worker("j1", gb=1.0, app_callbacks=True)
    hook = asyncio.create_task(_release_then_answer(app_rig, memory, 0, lag=0.0))
    assert (await app_rig.run("d1", CKPT, "j1", 1)).status == AckStatus.OK
    await hook
    memory.free = 2 * GIB
    ack = await app_rig.run("d2", REST, "j1", 1)
    assert ack.status == AckStatus.REFUSED
    assert "needs 6442450944 bytes" in ack.error and "2147483648 bytes" in ack.error
    assert app_rig.executor.jobs["j1"].state is JobState.SAVED
    assert reg.commands.empty()  # no hook was asked to restore anything
    # With room, the same restore runs and reports what came back.
    memory.free = 70 * GIB
    answer = asyncio.create_task(_answer(reg, app_rig, HookKind.AFTER_RESTORE, True, 9))

    async def refill() -> None:
        await answer
        memory.held[PID] = 6 * GIB

    filled = asyncio.create_task(refill())
    ack = await app_rig.run("d3", REST, "j1", 1)
    await filled
    assert ack.status == AckStatus.OK, ack.error


async def test_app_backend_refuses_a_job_with_no_app_worker(app_rig: Rig) -> None:
    app_rig.worker("j1", gb=1.0)
    ack = await app_rig.run("d1", CKPT, "j1", 1)
    assert ack.status == AckStatus.REFUSED and "app callbacks" in ack.error
    assert app_rig.executor.jobs["j1"].state is JobState.IDLE


# ----- discovery and the foreign-process guard, on real processes ----------------------------


def _labelled(job: str, group: str = "g1", node: str = "") -> subprocess.Popen[bytes]:
    env = {"PATH": os.environ["PATH"], "TIMESLICE_JOB_ID": job, "TIMESLICE_GROUP": group}
    if node:
        env["TIMESLICE_NODE"] = node
    proc = subprocess.Popen(["sleep", "60"], env=env)
    # Popen returns once exec has closed its pipe, which can be before the kernel has set up
    # the new image's environment: /proc/PID/environ can read empty for a moment (a label
    # check found no label once on a loaded machine).
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{proc.pid}/environ").read_bytes():
        assert time.monotonic() < deadline, "the labelled process never showed its environment"
        time.sleep(0.001)
    return proc


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for proc in made:
        if proc.poll() is None:
            os.kill(proc.pid, 18)  # SIGCONT first, so a frozen one dies at once
            proc.kill()
        proc.wait()


async def test_procfs_discovery_finds_labelled_processes_of_this_node(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    node = f"n-{uuid.uuid4().hex[:8]}"
    mine = _labelled("job-a", node=node)
    other_node = _labelled("job-a", node="somewhere-else")
    bad = _labelled("bad job id!", node=node)
    procs += [mine, other_node, bad]
    labels = labels_of(mine.pid)
    assert labels is not None and (labels.job_id, labels.group_id, labels.node) == (
        "job-a",
        "g1",
        node,
    )
    assert labels_of(bad.pid) is None  # malformed ids are ignored, not trusted
    found = await ProcessFinder(node=node, memory=None).scan()
    ours = [d for d in found if d.info.pid in {p.pid for p in procs}]
    assert [(d.info.job_id, d.info.group_id, d.info.pid) for d in ours] == [
        ("job-a", "g1", mine.pid)
    ]
    # Pinned to the process found: the backends act on the pid only while it is that process.
    assert [d.identity for d in ours] == [identity_of(mine.pid)]
    # With NVML, only processes that hold a device context are candidates.
    memory = FakeDeviceMemory(held={other_node.pid: GIB})
    assert await ProcessFinder(node=node, memory=memory).scan() == []


async def test_a_process_labelled_for_one_job_is_never_registered_or_moved_for_another(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    victim = _labelled("job-b")
    procs.append(victim)
    rig = Rig(tmp_path)
    try:
        with pytest.raises(PermissionDenied, match=f"pid {victim.pid} belongs to job job-b"):
            rig.registry.register(WorkerInfo(job_id="job-a", group_id="g1", pid=victim.pid))
        assert foreign_pids("job-a", [victim.pid, PID]) == [victim.pid]
        assert foreign_pids("job-b", [victim.pid]) == []
        # A pid parked by job-a in an earlier run that now belongs to job-b (pid reuse) is
        # not restored for job-a.
        rig.worker("job-a")
        assert (await rig.run("d1", CKPT, "job-a", 1)).status == AckStatus.OK
        rig.executor.jobs["job-a"].saved_pids = (victim.pid,)
        ack = await rig.run("d2", REST, "job-a", 1)
        assert ack.status == AckStatus.REFUSED and "another job" in ack.error
        assert process_state(victim.pid) != "T"
    finally:
        await rig.close()


async def test_agent_discovers_and_freezes_a_process_nobody_registered(
    hub: tuple[FakeHub, int], agents: AgentFactory, procs: list[subprocess.Popen[bytes]]
) -> None:
    fake_hub, port = hub
    node = f"disc-{uuid.uuid4().hex[:8]}"
    worker = _labelled("job-d", group="gd", node=node)
    procs.append(worker)
    agent = await agents(
        f"127.0.0.1:{port}", node=node, backend="freeze", extra=["--discover", "procfs"]
    ).start()
    hello = await fake_hub.next_hello()
    assert hello.discovery == "procfs" and hello.backend_mechanism == "freeze"
    assert [(w.job_id, w.pid) for w in hello.workers] == [("job-d", worker.pid)]
    assert await agent.metric("timeslice_agent_info", discovery="procfs") == 1.0
    ack = await fake_hub.execute(directive("c1", CKPT, "job-d", "gd", 1))
    assert ack.status == AckStatus.OK, ack.error

    async def frozen() -> bool:
        return process_state(worker.pid) == "T"

    await eventually(frozen, 5.0, "the discovered process to be frozen")
    ack = await fake_hub.execute(directive("r1", REST, "job-d", "gd", 1))
    assert ack.status == AckStatus.OK, ack.error
    assert process_state(worker.pid) != "T"
    # A labelled process started later is picked up without any registration.
    late = _labelled("job-d", group="gd", node=node)
    procs.append(late)
    changed = await fake_hub.workers_until(
        lambda w: late.pid in {x.pid for x in w.workers}, timeout=10.0
    )
    assert {x.pid for x in changed.workers} == {worker.pid, late.pid}


# ----- a failure after the backend moved the job is undone -----------------------------------


class FlakyMemory(FakeDeviceMemory):
    """NVML that stops answering once the job's processes were checkpointed."""

    async def held_by(self, pids: Collection[int]) -> int:
        if self.queries >= 1:
            raise TimeoutError("NVML did not answer within 10 s")
        return await super().held_by(pids)


@pytest.fixture
def sleeper(procs: list[subprocess.Popen[bytes]]) -> int:
    proc = subprocess.Popen(["sleep", "60"])
    procs.append(proc)
    return proc.pid


async def test_a_failed_check_after_a_cuda_checkpoint_puts_the_processes_back(
    tmp_path: Path, sleeper: int
) -> None:
    from test_cuda_backend import FakeDriver

    from timeslice_agent.backends import CudaBackend
    from timeslice_agent.backends.cuda import ProcessState

    driver = FakeDriver()
    rig = Rig(tmp_path, backend=CudaBackend(driver))
    rig.executor.memory_check = MemoryCheck(FlakyMemory(held={sleeper: GIB}), release_wait=0.2)
    try:
        rig.registry.register(WorkerInfo(job_id="j1", group_id="g1", pid=sleeper))
        ack = await rig.run("d1", CKPT, "j1", 1)
        assert ack.status == AckStatus.FAILED and "NVML did not answer" in ack.error
        # Locked, checkpointed, then (NVML failing) restored and unlocked again.
        assert [step for step, _ in driver.calls] == ["lock", "checkpoint", "restore", "unlock"]
        assert driver.states[sleeper] is ProcessState.RUNNING
        assert rig.executor.jobs["j1"].on_device

        # If the undo fails too, the job is recorded as parked, so a restore brings it back.
        driver.calls.clear()
        driver.fail[("restore", sleeper)] = "CUDA_ERROR_OUT_OF_MEMORY"
        rig.executor.memory_check = MemoryCheck(FlakyMemory(held={sleeper: GIB}), release_wait=0.2)
        ack = await rig.run("d2", CKPT, "j1", 2)
        assert ack.status == AckStatus.FAILED
        job = rig.executor.jobs["j1"]
        assert not job.on_device and job.saved_pids == (sleeper,)
        assert driver.states[sleeper] is ProcessState.CHECKPOINTED
        del driver.fail[("restore", sleeper)]
        rig.executor.memory_check = None
        ack = await rig.run("d3", REST, "j1", 2)
        assert ack.status == AckStatus.OK, ack.error
        assert driver.states[sleeper] is ProcessState.RUNNING
    finally:
        await rig.close()


async def test_agent_keeps_parked_processes_that_nvml_no_longer_lists(
    tmp_path: Path, sleeper: int
) -> None:
    from timeslice_agent.config import parse_config
    from timeslice_agent.jobs import Job, Residency
    from timeslice_agent.service import Agent

    argv = ["--orchestrator", "127.0.0.1:1", "--node", "n1", "--backend", "app", "--insecure"]
    config = parse_config([*argv, "--worker-socket", str(tmp_path / "a.sock")], {})
    agent = Agent(config, tracing=None)
    pinned = identity_of(sleeper)
    assert pinned is not None
    agent.executor.jobs["j1"] = Job(
        "j1",
        "g1",
        JobState.SAVED,
        Residency.HOST,
        saved_bytes=GIB,
        saved_pids=(sleeper, 999999),
        saved_identities=(pinned, dataclasses.replace(pinned, pid=999999)),
    )
    parked = await agent._parked([])
    assert [(d.info.job_id, d.info.group_id, d.info.pid) for d in parked] == [("j1", "g1", sleeper)]
    # A parked pid now held by another process (another start time) is not the job's.
    agent.executor.jobs["j1"].saved_identities = (
        dataclasses.replace(pinned, start_time=pinned.start_time - 1),
    )
    assert await agent._parked([]) == []
    agent.executor.jobs["j1"].saved_identities = (pinned,)
    assert await agent._parked(parked) == []  # already listed by the scan


async def test_host_admission_counts_what_nvml_measured_not_what_was_announced(
    app_rig: Rig,
) -> None:
    from timeslice_agent.hostmem import HostMemory

    # The worker announced 1 GB, but NVML sees 6 GiB on the device: that is what the host
    # would have to take, and a 4 GB host cannot.
    app_rig.executor.parts.host_memory = HostMemory(reserve_bytes=0, modelled_bytes=4_000_000_000)
    reg = app_rig.worker("j1", gb=1.0, app_callbacks=True)
    ack = await app_rig.run("d1", CKPT, "j1", 1)
    assert ack.status == AckStatus.REFUSED and "host memory admission" in ack.error
    assert "6.44 GB" in ack.error
    assert reg.commands.empty()  # refused before any hook was asked to move anything
