"""Directive execution in-process: fencing, idempotency, serialisation, deadlines, hooks.

The executor runs against the real sim backend, a real worker registry and a real state file;
only the stream is replaced by a queue of acks (the orchestrator side is the boundary).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from timeslice.errors import InvalidArgument
from timeslice_agent.backends import Backend, SimBackend
from timeslice_agent.backends.base import JobContext, Transfer
from timeslice_agent.config import GB, SimSettings
from timeslice_agent.executor import DirectiveExecutor, ExecutorSettings
from timeslice_agent.jobs import Job, JobState, Residency
from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.statefile import AgentState, StateStore, StateWriteError, load_state
from timeslice_agent.tasks import Supervisor
from timeslice_agent.workers import Registration, WorkerRegistry
from timeslice_proto.timeslice.v1 import (
    AckStatus,
    CommandResult,
    Directive,
    DirectiveAck,
    DirectiveKind,
    HookKind,
    StaleCause,
    WorkerInfo,
)
from timeslice_proto.timeslice.v1 import JobState as ProtoJobState

CKPT = DirectiveKind.CHECKPOINT
REST = DirectiveKind.RESTORE


def sim(bandwidth_gbps: float = 10.0, capacity_gb: float = 80.0) -> SimBackend:
    return SimBackend(
        SimSettings(
            capacity_bytes=int(capacity_gb * GB),
            bandwidth_bytes_per_s=bandwidth_gbps * GB,
            default_state_bytes=int(40 * GB),
            time_scale=1.0,
        )
    )


class Rig:
    """An executor with its registry, metrics and state file; acks land in a queue."""

    def __init__(
        self,
        tmp_path: Path,
        backend: Backend | None = None,
        rescan: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.backend = backend or sim()
        self.metrics = AgentMetrics(node="n1", backend="sim", emulated=True)
        self.supervisor = Supervisor(self.metrics)
        self.acks: asyncio.Queue[DirectiveAck] = asyncio.Queue()
        self.state_file = tmp_path / "state.json"
        self.registry = WorkerRegistry(
            on_change=lambda job: self.executor.on_workers_changed(job),
            check=lambda info: self.executor.check_registration(info),
        )
        self.executor = DirectiveExecutor(
            ExecutorSettings(node="n1", state_file=self.state_file, hook_timeout=0.5),
            backend=self.backend,
            registry=self.registry,
            metrics=self.metrics,
            supervisor=self.supervisor,
            send_ack=self.acks.put_nowait,
            rescan=rescan,
        )

    def worker(self, job: str, group: str = "g1", gb: float = 1.0, **kw: bool) -> Registration:
        info = WorkerInfo(
            job_id=job, group_id=group, pid=os.getpid(), state_bytes=int(gb * GB), **kw
        )
        return self.registry.register(info)

    def send(self, did: str, kind: DirectiveKind, job: str, epoch: int, **kw: object) -> None:
        group = str(kw.pop("group", "g1"))
        deadline_ms = int(kw.pop("deadline_ms", 0))  # type: ignore[call-overload]
        self.executor.handle(
            Directive(
                directive_id=did,
                group_id=group,
                epoch=epoch,
                kind=kind,
                job_id=job,
                deadline_ms=deadline_ms,
            )
        )

    async def ack(self, timeout: float = 5.0) -> DirectiveAck:
        async with asyncio.timeout(timeout):
            return await self.acks.get()

    async def run(
        self, did: str, kind: DirectiveKind, job: str, epoch: int, **kw: object
    ) -> DirectiveAck:
        self.send(did, kind, job, epoch, **kw)
        ack = await self.ack()
        assert ack.directive_id == did
        return ack

    def count(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def close(self) -> None:
        await self.executor.drain(2.0)
        await self.supervisor.cancel_all(2.0)


@pytest.fixture
async def rig(tmp_path: Path):  # type: ignore[no-untyped-def]
    r = Rig(tmp_path)
    yield r
    await r.close()


async def test_checkpoint_restore_and_ack_fields(rig: Rig) -> None:
    rig.worker("j1", gb=1.0)
    assert rig.executor.jobs["j1"].state is JobState.IDLE
    ack = await rig.run("d1", CKPT, "j1", 5)
    assert (ack.status, ack.bytes_moved, ack.job_state) == (AckStatus.OK, GB, ProtoJobState.SAVED)
    assert ack.emulated and ack.group_id == "g1" and ack.epoch == 5
    assert 0.09 <= ack.elapsed_seconds < 1.0  # 1 GB at 10 GB/s
    assert ack.started_at <= ack.finished_at
    ack = await rig.run("d2", REST, "j1", 5)
    assert (ack.status, ack.bytes_moved, ack.job_state) == (AckStatus.OK, GB, ProtoJobState.RUNNING)
    # Restoring a job already on the device moves nothing.
    ack = await rig.run("d3", REST, "j1", 5)
    assert (ack.status, ack.bytes_moved) == (AckStatus.OK, 0)
    # The state file followed every change.
    saved = load_state(rig.state_file, "n1")
    assert saved is not None and saved.epochs == {"g1": 5}
    assert saved.jobs["j1"].state is JobState.RUNNING
    assert [a.directive_id for a in saved.acks] == ["d1", "d2", "d3"]


async def test_checkpoint_without_workers_or_twice_moves_nothing(rig: Rig) -> None:
    ack = await rig.run("d1", CKPT, "ghost", 1)
    assert (ack.status, ack.bytes_moved, ack.job_state) == (
        AckStatus.OK,
        0,
        ProtoJobState.UNSPECIFIED,
    )
    assert (await rig.run("d2", REST, "ghost", 1)).bytes_moved == 0
    rig.worker("j1", gb=0.1)
    assert (await rig.run("d3", CKPT, "j1", 1)).bytes_moved == GB // 10
    again = await rig.run("d4", CKPT, "j1", 1)
    assert (again.status, again.bytes_moved, again.job_state) == (
        AckStatus.OK,
        0,
        ProtoJobState.SAVED,
    )


async def test_fencing_refuses_older_epochs_and_accepts_equal(rig: Rig) -> None:
    rig.worker("j1", gb=0.01)
    assert (await rig.run("d1", CKPT, "j1", 5)).status == AckStatus.OK
    stale = await rig.run("d2", REST, "j1", 4)
    assert stale.status == AckStatus.STALE_EPOCH
    assert "stale epoch 4" in stale.error and "epoch 5" in stale.error
    assert stale.stale_cause == StaleCause.GROUP_EPOCH  # the group's own fence, not the node's
    assert stale.job_state == ProtoJobState.SAVED  # nothing happened
    assert rig.count("timeslice_agent_directives_refused_total", reason="stale_epoch") == 1
    accepted = await rig.run("d3", REST, "j1", 5)
    assert accepted.status == AckStatus.OK and accepted.stale_cause == StaleCause.UNSPECIFIED
    # Epochs are per group: another group starts from scratch.
    rig.worker("k1", group="g2", gb=0.01)
    assert (await rig.run("d4", CKPT, "k1", 1, group="g2")).status == AckStatus.OK
    assert rig.executor.epochs == {"g1": 5, "g2": 1}


async def test_fencing_rechecked_when_a_queued_directive_gets_its_lock(rig: Rig) -> None:
    rig.worker("j1", gb=3.0)  # 0.3 s per move
    rig.worker("j2", gb=3.0)
    rig.send("a1", CKPT, "j1", 5)
    rig.send("a2", REST, "j1", 5)  # queued behind a1 (same job)
    await asyncio.sleep(0.05)  # a1 is executing now
    rig.send("b1", CKPT, "j2", 6)  # newer authority for the group, other job: runs at once
    acks = {a.directive_id: a for a in [await rig.ack(), await rig.ack(), await rig.ack()]}
    assert acks["a1"].status == AckStatus.OK
    assert acks["b1"].status == AckStatus.OK
    assert acks["a2"].status == AckStatus.STALE_EPOCH
    assert rig.executor.jobs["j1"].state is JobState.SAVED


async def test_same_job_serialised_other_jobs_concurrent(rig: Rig) -> None:
    rig.worker("j1", gb=10.0)
    rig.worker("j2", gb=10.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    rig.send("a", CKPT, "j1", 1)
    rig.send("b", CKPT, "j2", 1)
    await rig.ack()
    await rig.ack()
    assert loop.time() - started < 1.7  # two 1 s moves side by side (one after the other: 2 s)
    started = loop.time()
    rig.send("c", REST, "j1", 1)
    rig.send("d", CKPT, "j1", 1)
    first, second = await rig.ack(), await rig.ack()
    assert [first.directive_id, second.directive_id] == ["c", "d"]
    assert second.finished_at - first.finished_at >= 0.9  # d waited for c
    assert loop.time() - started >= 1.9
    assert second.job_state == ProtoJobState.SAVED


async def test_duplicate_ids_get_the_stored_ack_without_execution(rig: Rig) -> None:
    rig.worker("j1", gb=2.0)
    rig.send("d1", CKPT, "j1", 1)
    rig.send("d1", CKPT, "j1", 1)  # while the first copy is running
    one, two = await rig.ack(), await rig.ack()
    assert bytes(one) == bytes(two)
    again = await rig.run("d1", CKPT, "j1", 1)
    assert bytes(again) == bytes(one)
    assert rig.count("timeslice_agent_directives_total", kind="checkpoint", status="ok") == 1
    assert (
        rig.count(
            "timeslice_agent_bytes_moved_total", kind="checkpoint", backend="sim", emulated="true"
        )
        == 2 * GB
    )


async def test_acks_remembered_across_restart(tmp_path: Path) -> None:
    first = Rig(tmp_path)
    first.worker("j1", gb=0.01)
    original = await first.run("d1", CKPT, "j1", 3)
    await first.close()
    loaded = load_state(first.state_file, "n1")
    second = Rig(tmp_path)
    await second.executor.adopt(loaded)
    assert second.executor.epochs == {"g1": 3}
    assert second.executor.jobs["j1"].state is JobState.SAVED
    assert bytes(await second.run("d1", CKPT, "j1", 3)) == bytes(original)
    assert (await second.run("d2", CKPT, "j1", 2)).status == AckStatus.STALE_EPOCH
    # The sim re-adopted its host books: the restore moves the saved bytes back.
    restored = await second.run("d3", REST, "j1", 3)
    assert (restored.status, restored.bytes_moved) == (AckStatus.OK, GB // 100)
    await second.close()


async def test_deadline_cancels_the_backend_and_faults_the_job(rig: Rig) -> None:
    rig.worker("j1", gb=20.0)  # 2 s at 10 GB/s
    # A deadline of 0.5 s, well inside the move and well past the state file's fsync'd writes
    # (50 ms left them no room on a loaded machine's disk).
    ack = await rig.run("d1", CKPT, "j1", 1, deadline_ms=500)
    assert ack.status == AckStatus.FAILED
    assert ack.error.startswith("deadline exceeded after"), ack.error
    assert ack.elapsed_seconds < 1.5  # cancelled at its deadline, not after the 2 s move
    assert ack.job_state == ProtoJobState.FAULTED
    job = rig.executor.jobs["j1"]
    assert job.residency is Residency.DEVICE and "deadline" in job.reason
    assert isinstance(rig.backend, SimBackend) and rig.backend.host_bytes == 0
    # A faulted job whose state never left the device can be checkpointed again.
    ack = await rig.run("d2", CKPT, "j1", 1)
    assert (ack.status, ack.job_state, ack.bytes_moved) == (
        AckStatus.OK,
        ProtoJobState.SAVED,
        20 * GB,
    )
    assert job.reason == ""


async def test_deadline_while_waiting_for_the_job_lock(rig: Rig) -> None:
    rig.worker("j1", gb=5.0)  # 0.5 s
    rig.send("slow", CKPT, "j1", 1)
    rig.send("late", REST, "j1", 1, deadline_ms=100)
    late = await rig.ack()
    assert late.directive_id == "late" and late.status == AckStatus.FAILED
    assert "waiting for an earlier directive" in late.error
    assert (await rig.ack()).status == AckStatus.OK


async def test_invalid_directives_refused_and_change_nothing(rig: Rig) -> None:
    rig.worker("j1")
    bad = await rig.run("b1", CKPT, "../etc", 9)
    assert bad.status == AckStatus.REFUSED and "invalid directive" in bad.error
    bad = await rig.run("b2", DirectiveKind.UNSPECIFIED, "j1", 9)
    assert bad.status == AckStatus.REFUSED and "kind" in bad.error
    bad = await rig.run("b3", CKPT, "j1", 9, group="other")
    assert bad.status == AckStatus.REFUSED and "group g1" in bad.error
    assert rig.executor.epochs == {}
    assert rig.executor.jobs["j1"].state is JobState.IDLE
    assert rig.count("timeslice_agent_directives_refused_total", reason="invalid") == 3


async def test_restore_refused_when_the_device_is_full(tmp_path: Path) -> None:
    rig = Rig(tmp_path, backend=sim(bandwidth_gbps=1000, capacity_gb=80))
    rig.worker("j1", gb=50)
    rig.worker("j2", gb=50)
    assert (await rig.run("d1", CKPT, "j1", 1)).status == AckStatus.OK
    refused = await rig.run("d2", REST, "j1", 1)  # j2 still holds 50 of 80 GB
    assert refused.status == AckStatus.REFUSED
    assert refused.error.startswith("insufficient device memory: need 50000000000 bytes")
    assert refused.job_state == ProtoJobState.SAVED
    assert rig.count("timeslice_agent_directives_refused_total", reason="backend") == 1
    assert (await rig.run("d3", CKPT, "j2", 1)).status == AckStatus.OK
    assert (await rig.run("d4", REST, "j1", 1)).status == AckStatus.OK
    await rig.close()


async def _answer(reg: Registration, rig: Rig, kind: HookKind, ok: bool, nbytes: int) -> None:
    command = await asyncio.wait_for(reg.commands.get(), 5)
    assert command is not None and command.kind == kind and command.job_id == "j1"
    rig.registry.complete(
        CommandResult(
            command_id=command.command_id, ok=ok, error="" if ok else "boom", bytes_moved=nbytes
        )
    )


async def test_app_hooks_round_trip_and_add_bytes(rig: Rig) -> None:
    reg = rig.worker("j1", gb=0.1, app_callbacks=True)
    answer = asyncio.create_task(_answer(reg, rig, HookKind.BEFORE_CHECKPOINT, True, 1000))
    ack = await rig.run("d1", CKPT, "j1", 1)
    await answer
    assert (ack.status, ack.bytes_moved) == (AckStatus.OK, GB // 10 + 1000)
    answer = asyncio.create_task(_answer(reg, rig, HookKind.AFTER_RESTORE, True, 7))
    ack = await rig.run("d2", REST, "j1", 1)
    await answer
    assert (ack.status, ack.bytes_moved, ack.job_state) == (
        AckStatus.OK,
        GB // 10 + 7,
        ProtoJobState.RUNNING,
    )


async def test_failing_or_silent_hook_faults_the_job(rig: Rig) -> None:
    reg = rig.worker("j1", gb=0.1, app_callbacks=True)
    answer = asyncio.create_task(_answer(reg, rig, HookKind.BEFORE_CHECKPOINT, False, 0))
    ack = await rig.run("d1", CKPT, "j1", 1)
    await answer
    assert ack.status == AckStatus.FAILED and "boom" in ack.error
    assert ack.job_state == ProtoJobState.FAULTED and ack.bytes_moved == 0
    assert isinstance(rig.backend, SimBackend) and rig.backend.host_bytes == 0
    # Nobody answers: the hook timeout (0.5 s here) fails the directive.
    ack = await rig.run("d2", CKPT, "j1", 1)
    assert ack.status == AckStatus.FAILED and "timed out after 0.5 s" in ack.error
    # An answer after the timeout is refused as unknown.
    command = reg.commands.get_nowait()
    assert command is not None
    with pytest.raises(Exception, match="no pending command"):
        rig.registry.complete(CommandResult(command_id=command.command_id, ok=True))


async def test_worker_leaving_mid_hook_fails_the_directive(rig: Rig) -> None:
    reg = rig.worker("j1", gb=0.1, app_callbacks=True)
    rig.send("d1", CKPT, "j1", 1)
    command = await asyncio.wait_for(reg.commands.get(), 5)
    assert command is not None
    rig.registry.unregister(reg, "test says goodbye")
    ack = await rig.ack()
    assert ack.status == AckStatus.FAILED and "went away" in ack.error


async def test_registry_keeps_the_job_table_in_step(rig: Rig) -> None:
    reg = rig.worker("j1")
    with pytest.raises(InvalidArgument, match="group g1"):
        rig.worker("j1", group="g2")
    with pytest.raises(InvalidArgument):
        rig.registry.register(WorkerInfo(job_id="j1", group_id="g1", pid=0))
    rig.registry.unregister(reg, "exit")
    assert "j1" not in rig.executor.jobs  # nothing of it left on this node
    reg = rig.worker("j2", gb=0.01)
    await rig.run("d1", CKPT, "j2", 1)
    rig.registry.unregister(reg, "exit")
    assert rig.executor.jobs["j2"].state is JobState.SAVED  # parked state is kept


async def test_sweep_drops_registrations_of_dead_processes(rig: Rig) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    alive = rig.worker("j1")
    ghost = rig.registry.register(WorkerInfo(job_id="j2", group_id="g1", pid=dead.pid))
    assert rig.registry.sweep() == 1
    assert [w.pid for w in rig.registry.workers()] == [alive.info.pid]
    assert ghost.closed_reason is not None and "no longer exists" in ghost.closed_reason
    assert ghost.commands.get_nowait() is None  # its stream handler is told to end
    assert "j2" not in rig.executor.jobs


async def test_shutdown_interrupts_running_directives_and_refuses_new_ones(rig: Rig) -> None:
    rig.worker("j1", gb=30.0)  # 3 s
    rig.send("long", CKPT, "j1", 1)
    await asyncio.sleep(0.05)
    await rig.executor.drain(0.1)
    refused = await rig.run("new", CKPT, "j1", 1)
    assert refused.status == AckStatus.REFUSED and "shutting down" in refused.error
    await rig.supervisor.cancel_all(2.0)
    job = rig.executor.jobs["j1"]
    assert job.state is JobState.FAULTED and "interrupted" in job.reason
    assert job.residency is Residency.DEVICE
    # The interrupted directive's ack is remembered for a re-send after the restart.
    stored = rig.executor.snapshot().acks
    assert [(a.directive_id, a.status) for a in stored] == [("long", AckStatus.FAILED)]


async def test_adopt_faults_interrupted_transitions(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    state = AgentState(
        node="n1",
        epochs={"g1": 4},
        jobs={
            "j1": Job("j1", "g1", state=JobState.TRANSITIONING),
            "j2": Job("j2", "g1", state=JobState.SAVED, residency=Residency.HOST, saved_bytes=9),
        },
    )
    await rig.executor.adopt(state)
    assert rig.executor.jobs["j1"].state is JobState.FAULTED
    assert "restarted" in rig.executor.jobs["j1"].reason
    assert rig.executor.jobs["j2"].state is JobState.SAVED
    assert [r.job_id for r in rig.executor.reports()] == ["j1", "j2"]
    assert [(e.group_id, e.epoch) for e in rig.executor.epoch_list()] == [("g1", 4)]
    await rig.close()


async def test_fence_revision_refuses_older_epochs_of_every_group_and_persists(
    tmp_path: Path,
) -> None:
    first = Rig(tmp_path)
    first.worker("j1", gb=0.01)
    first.worker("k1", group="g2", gb=0.01)
    assert (await first.run("d1", CKPT, "j1", 5)).status == AckStatus.OK
    first.executor.adopt_fence(10)
    first.executor.adopt_fence(7)  # never lowered
    assert first.executor.fence_revision == 10
    # Below the fence: refused in the group it knew and in one it never saw, and nothing moves.
    stale = await first.run("d2", REST, "j1", 9)
    assert stale.status == AckStatus.STALE_EPOCH
    assert "fenced out at revision 10" in stale.error
    # The orchestrator reads this, not the text: the switch goes on without this node.
    assert stale.stale_cause == StaleCause.NODE_FENCED
    assert stale.job_state == ProtoJobState.SAVED
    other = await first.run("d3", CKPT, "k1", 8, group="g2")
    assert other.status == AckStatus.STALE_EPOCH
    assert other.stale_cause == StaleCause.NODE_FENCED
    assert first.executor.jobs["k1"].state is JobState.IDLE
    # Above it: accepted.
    assert (await first.run("d4", REST, "j1", 11)).status == AckStatus.OK
    await first.close()
    # The floor survives a restart (it comes back from the state file).
    second = Rig(tmp_path)
    await second.executor.adopt(load_state(first.state_file, "n1"))
    assert second.executor.fence_revision == 10
    second.worker("k1", group="g2", gb=0.01)
    after = await second.run("d5", CKPT, "k1", 9, group="g2")
    assert after.status == AckStatus.STALE_EPOCH and after.stale_cause == StaleCause.NODE_FENCED
    # A re-send of a fenced refusal after the restart is answered from the state file, cause
    # and all.
    assert (await second.run("d2", REST, "j1", 9)).stale_cause == StaleCause.NODE_FENCED
    await second.close()


async def test_stalled_agent_refuses_directives_without_remembering_them(rig: Rig) -> None:
    rig.worker("j1", gb=0.01)
    stall: list[str] = ["event loop stalled for 9.0 s: the node may have been fenced out"]
    rig.executor.stalled = lambda: stall[0] if stall else None
    rig.send("d1", CKPT, "j1", 5)
    # No ack: one queued for the next stream would answer the re-send of d1 there while the
    # re-send runs.
    with pytest.raises(TimeoutError):
        await rig.ack(timeout=0.3)
    assert rig.executor.jobs["j1"].state.value == "idle"  # nothing moved
    assert rig.executor.epochs == {}  # and no authority accepted
    assert rig.count("timeslice_agent_directives_refused_total", reason="stalled") == 1
    # Not remembered: the same directive, once the agent is trusted again, runs.
    stall.clear()
    assert (await rig.run("d1", CKPT, "j1", 5)).status == AckStatus.OK
    assert rig.executor.jobs["j1"].state is JobState.SAVED


class CountingSim(SimBackend):
    """The sim backend, counting the moves it is asked for."""

    def __init__(self) -> None:
        base = sim()
        super().__init__(base.settings)
        self.checkpoints = 0
        self.restores = 0

    async def checkpoint(self, job: JobContext) -> Transfer:
        self.checkpoints += 1
        return await super().checkpoint(job)

    async def restore(self, job: JobContext) -> Transfer:
        self.restores += 1
        return await super().restore(job)


class FillingDisk(StateStore):
    """A state store whose disk fills up: ``good`` more writes succeed, then ``bad`` fail
    (None: every one, until :meth:`heal`)."""

    def __init__(
        self, path: Path, snapshot: Callable[[], AgentState], good: int, bad: int | None
    ) -> None:
        super().__init__(path, snapshot)
        self.good = good
        self.bad = bad

    def heal(self) -> None:
        self.bad = 0

    async def save(self) -> None:
        if self.good > 0:
            self.good -= 1
        elif self.bad is None or self.bad > 0:
            if self.bad is not None:
                self.bad -= 1
            raise StateWriteError(
                f"cannot write state file {self.path}: [Errno 28] No space left on device"
            )
        await super().save()


async def fill_disk(rig: Rig, good: int, bad: int | None) -> FillingDisk:
    """Let pending writes finish, then put in a disk that fills up after ``good`` writes."""
    # A write still pending would race the new store's on the same temporary file.
    pending = rig.supervisor.running("persist")
    if pending:
        await asyncio.wait(pending)
    assert await rig.executor.persist()
    disk = FillingDisk(rig.state_file, rig.executor.snapshot, good, bad)
    rig.executor.durability.store = disk
    return disk


class DiskWatch:
    """What the executor told the link about its state file."""

    def __init__(self, rig: Rig) -> None:
        self.events: list[str] = []
        self.writable = asyncio.Event()
        durability = rig.executor.durability
        durability.on_unwritable = lambda reason: self.events.append(f"unwritable: {reason}")
        durability.on_writable = self._writable

    def _writable(self) -> None:
        self.events.append("writable")
        self.writable.set()


async def test_a_checkpoint_whose_outcome_cannot_be_written_is_not_answered(
    tmp_path: Path,
) -> None:
    first = Rig(tmp_path)
    watch = DiskWatch(first)
    first.worker("j1", gb=0.01)
    # The write before acting succeeds; every write after the checkpoint fails.
    disk = await fill_disk(first, good=1, bad=None)
    first.send("d1", CKPT, "j1", 3)
    # An OK would let the orchestrator restore the next job, while the file still says j1 is
    # on the devices (mid-move): a restart would fault it there. A FAILED faulted the jobs for
    # the disk (issue 37, 5). Nothing is answered: the node says it cannot write (the
    # orchestrator fences it out) and answers nothing until it can.
    with pytest.raises(TimeoutError):
        await first.ack(timeout=0.5)
    assert len(watch.events) == 1 and "No space left" in watch.events[0], watch.events
    assert first.executor.unwritable is not None
    on_disk = load_state(first.state_file, "n1")
    assert on_disk is not None and on_disk.jobs["j1"].state is JobState.TRANSITIONING
    # In memory the job is where the move left it: the state is parked on the host.
    job = first.executor.jobs["j1"]
    assert (job.state, job.residency) == (JobState.SAVED, Residency.HOST)
    # Meanwhile no directive is answered, nor remembered.
    first.send("d2", REST, "j1", 3)
    with pytest.raises(TimeoutError):
        await first.ack(timeout=0.3)
    assert first.count("timeslice_agent_directives_refused_total", reason="unwritable") == 1
    assert backend_state(first) == (JobState.SAVED, Residency.HOST)
    # The disk has room again: the background retry writes the job and d1's ack.
    disk.heal()
    await asyncio.wait_for(watch.writable.wait(), 5)
    assert watch.events[1:] == ["writable"] and first.executor.unwritable is None
    on_disk = load_state(first.state_file, "n1")
    assert on_disk is not None and on_disk.jobs["j1"].state is JobState.SAVED
    assert [a.directive_id for a in on_disk.acks] == ["d1"]
    await first.close()
    backend = CountingSim()
    second = Rig(tmp_path, backend)
    await second.executor.adopt(load_state(first.state_file, "n1"))
    # A re-send of the checkpoint is answered OK from the ledger; nothing runs again.
    resent = await second.run("d1", CKPT, "j1", 3)
    assert (resent.status, resent.job_state) == (AckStatus.OK, ProtoJobState.SAVED)
    assert backend.checkpoints == 0
    second.worker("j1", gb=0.01)
    restored = await second.run("d3", REST, "j1", 4)
    assert (restored.status, restored.job_state) == (AckStatus.OK, ProtoJobState.RUNNING)
    assert backend.restores == 1 and restored.bytes_moved == GB // 100
    await second.close()


def backend_state(rig: Rig) -> tuple[JobState, Residency]:
    job = rig.executor.jobs["j1"]
    return job.state, job.residency


async def test_a_restore_whose_outcome_cannot_be_written_is_not_answered(tmp_path: Path) -> None:
    first = Rig(tmp_path)
    watch = DiskWatch(first)
    first.worker("j1", gb=0.01)
    assert (await first.run("d1", CKPT, "j1", 3)).status == AckStatus.OK
    disk = await fill_disk(first, good=1, bad=None)
    first.send("d2", REST, "j1", 3)
    with pytest.raises(TimeoutError):
        await first.ack(timeout=0.5)
    assert len(watch.events) == 1, watch.events
    assert backend_state(first) == (JobState.RUNNING, Residency.DEVICE)
    disk.heal()
    await asyncio.wait_for(watch.writable.wait(), 5)
    await first.close()
    on_disk = load_state(first.state_file, "n1")
    assert on_disk is not None and on_disk.jobs["j1"].state is JobState.RUNNING
    backend = CountingSim()
    second = Rig(tmp_path, backend)
    await second.executor.adopt(on_disk)
    second.worker("j1", gb=0.01)
    checkpointed = await second.run("d3", CKPT, "j1", 4)
    assert (checkpointed.status, checkpointed.bytes_moved) == (AckStatus.OK, GB // 100)
    assert backend.checkpoints == 1
    await second.close()


async def test_a_write_that_fails_before_acting_faults_nothing(tmp_path: Path) -> None:
    backend = CountingSim()
    rig = Rig(tmp_path, backend)
    watch = DiskWatch(rig)
    try:
        rig.worker("j1", gb=0.01)
        disk = await fill_disk(rig, good=0, bad=None)
        rig.send("d1", CKPT, "j1", 3)
        # Before: acked FAILED "cannot persist state before acting", and the orchestrator
        # faulted (isolated) the job for the node's disk.
        with pytest.raises(TimeoutError):
            await rig.ack(timeout=0.5)
        assert backend.checkpoints == 0
        assert backend_state(rig) == (JobState.IDLE, Residency.DEVICE)  # not faulted
        assert len(watch.events) == 1, watch.events
        disk.heal()
        await asyncio.wait_for(watch.writable.wait(), 5)
        # Not remembered: once the node rejoins, the directive (re-sent) runs.
        assert (await rig.run("d1", CKPT, "j1", 3)).status == AckStatus.OK
        assert backend.checkpoints == 1
    finally:
        await rig.close()


async def test_a_failed_write_after_a_move_is_retried_and_the_node_rejoins(rig: Rig) -> None:
    watch = DiskWatch(rig)
    rig.worker("j1", gb=0.01)
    await fill_disk(rig, good=1, bad=1)  # the first write after the checkpoint fails
    rig.send("d1", CKPT, "j1", 3)
    await asyncio.wait_for(watch.writable.wait(), 5)
    assert rig.count("timeslice_agent_state_write_failures_total") == 1
    # Written by the retry: a restart now finds the job parked, with its ack.
    on_disk = load_state(rig.state_file, "n1")
    assert on_disk is not None and on_disk.jobs["j1"].state is JobState.SAVED
    assert [a.directive_id for a in on_disk.acks] == ["d1"]
    # Unanswered when it was done; a re-send (on the next stream) gets the OK.
    assert rig.acks.empty()
    assert (await rig.run("d1", CKPT, "j1", 3)).status == AckStatus.OK


async def test_a_process_scan_that_never_ends_does_not_hold_a_checkpoint(tmp_path: Path) -> None:
    """A scan stuck on a process in the kernel (a hung GPU) stalled every checkpoint for good;
    the scan before a checkpoint is best effort and short, the periodic one goes on."""

    async def stuck() -> None:
        await asyncio.Event().wait()

    rig = Rig(tmp_path, rescan=stuck)
    try:
        rig.worker("j1", gb=1.0)
        rig.send("d1", CKPT, "j1", 5, deadline_ms=10_000)
        ack = await rig.ack(timeout=6.0)
        assert (ack.status, ack.job_state) == (AckStatus.OK, ProtoJobState.SAVED)
    finally:
        await rig.close()


async def test_a_process_whose_environment_cannot_be_read_is_refused_within_the_deadline(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    unblock = threading.Event()

    calls = 0

    def stuck_read(job_id: str, pids: object) -> list[int]:
        nonlocal calls
        calls += 1
        unblock.wait(10)  # a read of /proc/<pid>/environ blocked on the process's mmap lock
        return []

    monkeypatch.setattr("timeslice_agent.procedures.foreign_pids", stuck_read)
    try:
        rig.worker("j1", gb=1.0)
        rig.send("d1", CKPT, "j1", 5, deadline_ms=500)
        ack = await rig.ack(timeout=3.0)
        assert ack.status is AckStatus.REFUSED and "within the deadline" in ack.error
        assert rig.executor.jobs["j1"].state is JobState.IDLE  # nothing acted
        # The read is still blocked: the next directive does not start another (a thread
        # each would use up the pool every to_thread of the agent shares).
        rig.send("d2", CKPT, "j1", 6, deadline_ms=500)
        ack = await rig.ack(timeout=3.0)
        assert ack.status is AckStatus.REFUSED and "still blocked" in ack.error
        assert calls == 1
    finally:
        unblock.set()


async def _answer_with(
    reg: Registration,
    rig: Rig,
    kind: HookKind,
    job: str,
    *,
    bytes_moved: int = 0,
    bytes_skipped: int = 0,
    host_bytes_kept: int = 0,
) -> None:
    command = await asyncio.wait_for(reg.commands.get(), 5)
    assert command is not None and command.kind == kind and command.job_id == job
    rig.registry.complete(
        CommandResult(
            command_id=command.command_id,
            ok=True,
            bytes_moved=bytes_moved,
            bytes_skipped=bytes_skipped,
            host_bytes_kept=host_bytes_kept,
        )
    )


async def test_skipped_bytes_reach_the_ack_journal_and_metrics(rig: Rig) -> None:
    reg = rig.worker("j1", gb=0.1, app_callbacks=True)
    answer = asyncio.create_task(
        _answer_with(
            reg, rig, HookKind.BEFORE_CHECKPOINT, "j1", bytes_moved=5000, bytes_skipped=4000
        )
    )
    ack = await rig.run("d1", CKPT, "j1", 1)
    await answer
    assert (ack.status, ack.bytes_moved, ack.bytes_skipped) == (
        AckStatus.OK,
        GB // 10 + 5000,
        4000,
    )
    labels = {"kind": "checkpoint", "backend": "sim", "emulated": "true"}
    assert rig.count("timeslice_agent_bytes_skipped_total", **labels) == 4000
    assert rig.count("timeslice_agent_bytes_moved_total", **labels) == GB // 10 + 5000


async def test_host_admission_does_not_ask_again_for_a_kept_host_copy(rig: Rig) -> None:
    """A job whose workers keep their host copy after a restore (TorchOffloader keep_pinned)
    needs no new host memory at its next checkpoint; that copy still counts as taken when
    another job asks."""
    from timeslice_agent.hostmem import HostMemory

    rig.executor.parts.host_memory = HostMemory(reserve_bytes=0, modelled_bytes=int(1.5 * GB))
    keeper = rig.worker("j1", gb=1.0, app_callbacks=True)
    other = rig.worker("j2", group="g2", gb=1.0)
    hook = asyncio.create_task(
        _answer_with(keeper, rig, HookKind.BEFORE_CHECKPOINT, "j1", bytes_moved=GB)
    )
    assert (await rig.run("d1", CKPT, "j1", 1)).status == AckStatus.OK
    await hook
    hook = asyncio.create_task(
        _answer_with(keeper, rig, HookKind.AFTER_RESTORE, "j1", bytes_moved=GB, host_bytes_kept=GB)
    )
    assert (await rig.run("d2", REST, "j1", 1)).status == AckStatus.OK
    await hook
    # j1 is back on the device, its 1 GB host copy kept: j2's 1 GB does not fit beside it.
    refused = await rig.run("d3", CKPT, "j2", 1, group="g2")
    assert refused.status == AckStatus.REFUSED and "host memory admission" in refused.error
    assert other.commands.empty()
    rig.executor.parts.host_memory = HostMemory(reserve_bytes=0, modelled_bytes=int(2.5 * GB))
    assert (await rig.run("d4", CKPT, "j2", 2, group="g2")).status == AckStatus.OK
    # j2 parked (1 GB), 0.8 GB left: j1's 1 GB fits only because it fills the copy it keeps.
    rig.executor.parts.host_memory = HostMemory(reserve_bytes=0, modelled_bytes=int(1.8 * GB))
    hook = asyncio.create_task(
        _answer_with(keeper, rig, HookKind.BEFORE_CHECKPOINT, "j1", bytes_moved=GB)
    )
    assert (await rig.run("d5", CKPT, "j1", 2)).status == AckStatus.OK
    await hook


async def test_the_host_figure_reported_is_the_one_admission_counts(rig: Rig) -> None:
    """Parked states and kept host copies (the checkpointing job's own included) are what a
    modelled host has given away: admission refuses from that figure, and it is the figure the
    agent reports as host memory free."""
    from timeslice_agent.hostmem import HostMemory

    host = HostMemory(reserve_bytes=0, modelled_bytes=int(2.2 * GB))
    rig.executor.parts.host_memory = host
    table = rig.executor.table

    def free() -> int | None:
        return host.report(table.parked_bytes())

    keeper = rig.worker("j1", gb=2.0, app_callbacks=True)
    rig.worker("j2", group="g2", gb=0.5)
    assert (table.parked_bytes(), free()) == (0, int(2.2 * GB))
    hook = asyncio.create_task(_answer_with(keeper, rig, HookKind.BEFORE_CHECKPOINT, "j1"))
    assert (await rig.run("d1", CKPT, "j1", 1)).status == AckStatus.OK
    await hook
    assert (table.parked_bytes(), free()) == (2 * GB, int(0.2 * GB))
    hook = asyncio.create_task(
        _answer_with(keeper, rig, HookKind.AFTER_RESTORE, "j1", bytes_moved=GB, host_bytes_kept=GB)
    )
    assert (await rig.run("d2", REST, "j1", 1)).status == AckStatus.OK
    await hook
    # j1 is back on the device and keeps a 1 GB host copy: still taken.
    assert (table.parked_bytes(), free()) == (GB, int(1.2 * GB))
    assert (await rig.run("d3", CKPT, "j2", 1, group="g2")).status == AckStatus.OK
    assert (table.parked_bytes(), free()) == (int(1.5 * GB), int(0.7 * GB))
    # j1's 2 GB checkpoint adds 1 GB to the copy it keeps, and 0.7 GB is free: refused.
    refused = await rig.run("d4", CKPT, "j1", 2)
    assert refused.status == AckStatus.REFUSED and "host memory admission" in refused.error
    assert "needs 1.00 GB" in refused.error and "0.70 GB" in refused.error
    assert keeper.commands.empty()
    # A modelled host given away past its size reports 0 free, not a negative figure.
    overfull = HostMemory(reserve_bytes=0, modelled_bytes=GB)
    assert overfull.report(table.parked_bytes()) == 0
