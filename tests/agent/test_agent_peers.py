"""The agent acts only on what it may touch (issue 10, item 3).

Real agent processes, real worker processes and real ``sleep`` victims: a worker registers
only itself or its descendants (checked with SO_PEERCRED), the backends act on a pid only
while it is the very process that was registered (pid reuse is produced for real through
``/proc/sys/kernel/ns_last_pid``), and the worker socket is 0660 with the configured group.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import os
import pwd
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import AgentFactory, FakeHub, WorkerProcess, directive, eventually
from grpclib.client import Channel
from grpclib.exceptions import GRPCError
from test_agent_executor import CKPT, REST, Rig

from timeslice.errors import PermissionDenied
from timeslice_agent.backends import BackendRefused, CudaBackend, FreezeBackend, JobContext
from timeslice_agent.backends.cuda import ProcessState
from timeslice_agent.peers import PeerCredentials, authorize_registration
from timeslice_agent.procs import identity_of, process_state
from timeslice_proto.timeslice.v1 import AckStatus, WorkerInfo, WorkerLinkStub

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for proc in made:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait()


def sleeper(procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sleep", "60"])
    procs.append(proc)
    return proc


def respawn_at(pid: int, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """A new ``sleep`` at ``pid``, which just became free: a real pid reuse.

    Start times count clock ticks (10 ms at USER_HZ 100): a pid reused within the same tick
    would look like the same process. Cycling through pid_max (4M) in 10 ms is not possible
    without forcing the pid as here (CAP_SYS_ADMIN), so the reuse waits out the tick.
    """
    time.sleep(3 / os.sysconf("SC_CLK_TCK"))
    for _ in range(100):
        try:
            NS_LAST_PID.write_text(str(pid - 1))
        except OSError as exc:
            pytest.skip(f"pid reuse needs a writable {NS_LAST_PID} (root, host pid ns): {exc}")
        proc = subprocess.Popen(["sleep", "60"])
        if proc.pid == pid:
            procs.append(proc)
            return proc
        proc.kill()
        proc.wait()
    raise AssertionError(f"could not get pid {pid} again (another process keeps taking it)")


async def asleep(pid: int) -> None:
    """Wait until ``pid`` sleeps (S): a process just started runs (R) for a moment."""

    async def sleeping() -> bool:
        return process_state(pid) == "S"

    await eventually(sleeping, what=f"pid {pid} to sleep")


class StateSampler:
    """Samples a process's /proc state every millisecond while a switch runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.states: list[str | None] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            self.states.append(process_state(self.pid))
            await asyncio.sleep(0.001)

    async def __aenter__(self) -> StateSampler:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self.states.append(process_state(self.pid))
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


# ----- the worker socket --------------------------------------------------------------------


async def test_worker_socket_is_0660_with_the_configured_group(
    hub: tuple[FakeHub, int], agents: AgentFactory, short_dir: Path
) -> None:
    _, port = hub
    daemon = grp.getgrnam("daemon").gr_gid
    assert daemon != os.getgid()
    configured = await agents(
        f"127.0.0.1:{port}", node="node-a", extra=["--worker-socket-group", "daemon"]
    ).start()
    default = await agents(f"127.0.0.1:{port}", node="node-b", socket=short_dir / "b.sock").start()
    st = os.stat(configured.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, daemon)
    st = os.stat(default.socket)
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o660, os.getgid())


async def test_an_unknown_socket_group_fails_the_start(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    _, port = hub
    agent = agents(f"127.0.0.1:{port}", extra=["--worker-socket-group", "no-such-group-x"])
    code, err = await agent.run_to_exit()
    assert code == 2 and "no-such-group-x" in err and "no such group" in err


# ----- registrations ------------------------------------------------------------------------


async def test_a_foreign_pid_is_refused_and_never_stopped_through_a_switch(
    hub: tuple[FakeHub, int], agents: AgentFactory, procs: list[subprocess.Popen[bytes]]
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", backend="freeze").start()
    await h.next_hello()
    victim = sleeper(procs)  # the test's child: no descendant of the worker
    await asleep(victim.pid)
    intruder = await WorkerProcess(agent.socket, "job-x", "grp", "--pid", str(victim.pid)).start(
        expect_registered=False
    )
    refusal = await intruder.next_event()
    assert refusal["kind"] == "ERROR" and refusal["status"] == "PERMISSION_DENIED", refusal
    assert f"pid {victim.pid} is neither the registering process" in refusal["message"]
    await agent.wait_line(rf"worker registration refused: .*pid {victim.pid}")
    # The job's real worker registers; a whole switch runs; the victim never stops.
    worker = await WorkerProcess(agent.socket, "job-x", "grp").start()
    changed = await h.next_workers()
    assert [w.pid for w in changed.workers] == [worker.pid]  # nothing of the intruder's
    async with StateSampler(victim.pid) as victim_states, StateSampler(worker.pid) as mine:
        ack = await h.execute(directive("x-1", CKPT, "job-x", "grp", 1))
        assert ack.status == AckStatus.OK, ack.error
        assert process_state(worker.pid) == "T"
        ack = await h.execute(directive("x-2", REST, "job-x", "grp", 1))
        assert ack.status == AckStatus.OK, ack.error
    assert "T" in mine.states  # the switch really froze the job
    assert victim_states.states and set(victim_states.states) == {"S"}
    assert f"worker registered: job job-x group grp pid {victim.pid}" not in agent.log()
    await intruder.kill()
    await worker.kill()


async def test_pid_1_and_the_agent_itself_are_refused(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", backend="freeze").start()
    await h.next_hello()
    assert agent.proc is not None
    for pid in (1, agent.proc.pid):
        worker = await WorkerProcess(agent.socket, "job-y", "grp", "--pid", str(pid)).start(
            expect_registered=False
        )
        event = await worker.next_event()
        assert (event["kind"], event["status"]) == ("ERROR", "PERMISSION_DENIED"), event
        await worker.kill()


async def test_a_descendant_registers_and_is_frozen_and_resumed(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", backend="freeze").start()
    await h.next_hello()
    worker = WorkerProcess(agent.socket, "job-d", "grp", "--child")
    await worker.start(expect_registered=False)
    child = (await worker.next_event())["pid"]
    try:
        assert (await worker.next_event())["kind"] == "REGISTERED"
        changed = await h.next_workers()
        assert [w.pid for w in changed.workers] == [child]
        ack = await h.execute(directive("d-1", CKPT, "job-d", "grp", 1))
        assert ack.status == AckStatus.OK, ack.error
        assert process_state(child) == "T"
        assert process_state(worker.pid) in ("S", "R")  # only the registered process
        ack = await h.execute(directive("d-2", REST, "job-d", "grp", 1))
        assert ack.status == AckStatus.OK, ack.error
        assert process_state(child) in ("S", "R")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
        await worker.kill()


async def test_a_reused_pid_is_never_signalled_by_the_agent(
    hub: tuple[FakeHub, int], agents: AgentFactory, procs: list[subprocess.Popen[bytes]]
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", backend="freeze").start()
    await h.next_hello()
    worker = WorkerProcess(agent.socket, "job-r", "grp", "--child")
    await worker.start(expect_registered=False)
    child = (await worker.next_event())["pid"]
    try:
        assert (await worker.next_event())["kind"] == "REGISTERED"
        await h.next_workers()
        os.kill(child, signal.SIGKILL)  # the worker reaps it at once (SIGCHLD ignored)
        newcomer = respawn_at(child, procs)
        await asleep(newcomer.pid)
        async with StateSampler(newcomer.pid) as sampled:
            ack = await h.execute(directive("r-1", CKPT, "job-r", "grp", 1))
        # Either the sweep already dropped the registration (nothing to move) or the backend
        # refused the reused pid; never is the newcomer stopped.
        assert ack.status in (AckStatus.OK, AckStatus.REFUSED), ack.error
        if ack.status == AckStatus.REFUSED:
            assert "the pid was reused" in ack.error
        assert sampled.states and set(sampled.states) == {"S"}
    finally:
        await worker.kill()


# ----- a worker of another uid ----------------------------------------------------------------


def _register_as_nobody(socket_path: Path, pid: int) -> dict[str, object]:
    """Fork, become ``nobody`` and register ``pid`` (0: the child itself); what happened."""
    nobody = pwd.getpwnam("nobody")
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the forked child reports through the pipe
        os.close(read)
        result: dict[str, object]
        try:
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            result = asyncio.new_event_loop().run_until_complete(
                _register_once(str(socket_path), pid or os.getpid())
            )
        except BaseException as exc:
            result = {"kind": "EXCEPTION", "error": repr(exc)}
        os.write(write, json.dumps(result).encode())
        os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as f:
            raw = f.read()
    finally:
        os.waitpid(child, 0)
    return dict(json.loads(raw))


async def _register_once(path: str, pid: int) -> dict[str, object]:
    channel = Channel(path=path)
    try:
        stub = WorkerLinkStub(channel)
        info = WorkerInfo(job_id="job-n", group_id="grp", pid=pid)
        async with asyncio.timeout(10):
            async for command in stub.register(info):
                return {"kind": command.kind.name}
        return {"kind": "END"}
    except GRPCError as exc:
        return {"kind": "ERROR", "status": exc.status.name, "message": exc.message or ""}
    except OSError as exc:
        return {"kind": "OSERROR", "errno": exc.errno}
    finally:
        channel.close()


async def test_another_uid_cannot_connect_without_the_group_nor_register_foreign_pids(
    hub: tuple[FakeHub, int],
    agents: AgentFactory,
    short_dir: Path,
    procs: list[subprocess.Popen[bytes]],
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to become nobody")
    _, port = hub
    await asyncio.to_thread(
        short_dir.chmod, 0o755
    )  # nobody must reach the socket; the socket's own mode decides
    closed = await agents(f"127.0.0.1:{port}", node="node-a").start()
    result = await asyncio.to_thread(_register_as_nobody, closed.socket, 0)
    assert result["kind"] in ("OSERROR", "ERROR"), result  # EACCES, or UNAVAILABLE from grpclib
    assert "REGISTERED" not in json.dumps(result)

    shared = await agents(
        f"127.0.0.1:{port}",
        node="node-b",
        backend="freeze",
        socket=short_dir / "b.sock",
        extra=["--worker-socket-group", "nogroup"],
    ).start()
    assert await asyncio.to_thread(_register_as_nobody, shared.socket, 0) == {"kind": "REGISTERED"}
    victim = sleeper(procs)  # root's process
    result = await asyncio.to_thread(_register_as_nobody, shared.socket, victim.pid)
    assert (result["kind"], result["status"]) == ("ERROR", "PERMISSION_DENIED"), result
    assert "may only register its own processes" in str(result["message"])
    assert process_state(victim.pid) == "S"


# ----- the rules themselves, on real processes ------------------------------------------------


def test_authorize_registration_follows_the_parent_chain(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    me = PeerCredentials(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
    child = sleeper(procs)
    pinned = authorize_registration(me, child.pid, "j1", own_pid=-1)
    assert pinned == identity_of(child.pid)
    # A grandchild (through a shell) is a descendant too.
    shell = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE)
    procs.append(shell)
    assert shell.stdout is not None
    grandchild = int(shell.stdout.readline())
    try:
        assert authorize_registration(me, grandchild, "j1", own_pid=-1).pid == grandchild
        # The shell is not the grandchild's peer's parent the other way round.
        as_shell = PeerCredentials(pid=shell.pid, uid=os.geteuid(), gid=os.getegid())
        with pytest.raises(PermissionDenied, match="descendants"):
            authorize_registration(as_shell, child.pid, "j1", own_pid=-1)
        with pytest.raises(PermissionDenied, match="cannot be registered"):
            authorize_registration(me, os.getpid(), "j1", own_pid=os.getpid())
    finally:
        os.kill(grandchild, signal.SIGKILL)


async def test_freeze_backend_refuses_a_reused_pid(procs: list[subprocess.Popen[bytes]]) -> None:
    old = sleeper(procs)
    pinned = identity_of(old.pid)
    assert pinned is not None
    old.kill()
    old.wait()
    newcomer = respawn_at(pinned.pid, procs)
    await asleep(newcomer.pid)
    worker = WorkerInfo(job_id="j1", group_id="g1", pid=pinned.pid)
    ctx = JobContext("j1", "g1", workers=(worker,), identities=(pinned,))
    with pytest.raises(BackendRefused, match="the pid was reused"):
        await FreezeBackend().checkpoint(ctx)
    assert process_state(newcomer.pid) == "S"
    # A restore does not resume it either: the frozen process it stood for is gone.
    saved = JobContext("j1", "g1", saved_pids=(pinned.pid,), identities=(pinned,))
    os.kill(newcomer.pid, signal.SIGSTOP)

    async def stopped() -> bool:
        return process_state(newcomer.pid) == "T"

    try:
        await eventually(stopped, what="the newcomer to stop")
        with pytest.raises(Exception, match="vanished while frozen"):
            await FreezeBackend().restore(saved)
        assert process_state(newcomer.pid) == "T"
    finally:
        os.kill(newcomer.pid, signal.SIGCONT)


async def test_cuda_backend_refuses_a_reused_pid_before_any_driver_call(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    from test_cuda_backend import FakeDriver

    old = sleeper(procs)
    pinned = identity_of(old.pid)
    assert pinned is not None
    old.kill()
    old.wait()
    respawn_at(pinned.pid, procs)
    driver = FakeDriver()
    worker = WorkerInfo(job_id="j1", group_id="g1", pid=pinned.pid)
    ctx = JobContext("j1", "g1", workers=(worker,), saved_pids=(pinned.pid,), identities=(pinned,))
    backend = CudaBackend(driver)
    with pytest.raises(BackendRefused, match="the pid was reused"):
        await backend.checkpoint(ctx)
    with pytest.raises(BackendRefused, match="the pid was reused"):
        await backend.restore(ctx)
    assert driver.calls == []
    driver.states[pinned.pid] = ProcessState.CHECKPOINTED
    from timeslice_agent.backends import SavedJob

    reason = await backend.reconcile(SavedJob("j1", "g1", 0, (pinned.pid,), (pinned,)))
    assert reason is not None and "reused" in reason


async def test_the_sweep_drops_a_registration_whose_pid_was_reused(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    rig = Rig(tmp_path)
    old = sleeper(procs)
    rig.registry.register(WorkerInfo(job_id="j1", group_id="g1", pid=old.pid))
    assert rig.registry.sweep() == 0
    old.kill()
    old.wait()
    respawn_at(old.pid, procs)
    assert rig.registry.sweep() == 1
    assert rig.registry.workers_of("j1") == []
    await rig.close()
