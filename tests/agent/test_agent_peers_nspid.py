"""Workers in a pid namespace of their own (a pod without ``hostPID``) register with pids of it.

Real agent, real workers started in a new pid namespace (``unshare --pid --fork --mount-proc``,
as root), real victims: the worker sends the pid it sees, the agent translates it through
``NSpid`` to the same process's pid on the node, and acts on that process only. The namespace's
pid of the worker is forced (``ns_last_pid`` inside the namespace) to equal the pid of a host
process, which must never be touched.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import WORKER_SCRIPT, AgentFactory, FakeHub, WorkerProcess, directive
from test_agent_executor import CKPT, REST
from test_agent_peers import StateSampler, asleep, sleeper

from timeslice.errors import PermissionDenied
from timeslice_agent.peers import PeerCredentials, RegistrationRefused, authorize_registration
from timeslice_agent.procs import ProcWalkTimeout, descendants_of, process_state
from timeslice_proto.timeslice.v1 import AckStatus

UNSHARE = shutil.which("unshare")


def _can_unshare() -> bool:
    if os.geteuid() != 0 or UNSHARE is None:
        return False
    done = subprocess.run(
        [UNSHARE, "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=10
    )
    return done.returncode == 0


pytestmark = pytest.mark.skipif(
    not _can_unshare(), reason="needs root and unshare(1) to make pid namespaces"
)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    made: list[subprocess.Popen[bytes]] = []
    yield made
    for proc in made:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _worker(socket: Path, job: str, *args: str) -> str:
    argv = [sys.executable, str(WORKER_SCRIPT), "--socket", str(socket), "--job", job]
    return shlex.join([*argv, "--group", "grp", *args])


def in_namespace(lines: list[str], *, pin_pid: int = 0) -> WorkerProcess:
    """A WorkerProcess whose shell runs as pid 1 of a new pid namespace.

    The shell first starts a ``sleep`` (its child, no worker's descendant), printed as
    ``SIBLING`` with its pid in the namespace, then runs ``lines`` in order, each in the
    foreground. With ``pin_pid`` the first of them gets that pid in the namespace.
    """
    script = ['sleep 60 & echo "{\\"kind\\": \\"SIBLING\\", \\"pid\\": $!}"']
    if pin_pid:
        script.append(f"echo {pin_pid - 1} > /proc/sys/kernel/ns_last_pid")
    script += lines
    worker = WorkerProcess(Path("/"), "unused", "unused")
    assert UNSHARE is not None
    worker.argv = [
        UNSHARE, "--pid", "--kill-child", "--mount-proc", "sh", "-c", "\n".join(script),
    ]  # fmt: skip
    return worker


def _nspid(pid: int) -> list[int]:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(x) for x in line.split()[1:]]
    raise AssertionError(f"no NSpid for pid {pid}")


def _ppid(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rfind(")") + 2 :].split()[1])


def host_pid(root: int, ns_pid: int) -> int:
    """The node's pid of the process below ``root`` whose pid in its namespace is ``ns_pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            chain = _nspid(pid)
            ancestors = [pid]
            while ancestors[-1] > 1 and ancestors[-1] != root:
                ancestors.append(_ppid(ancestors[-1]))
        except (OSError, AssertionError):
            continue
        if len(chain) >= 2 and chain[-1] == ns_pid and ancestors[-1] == root:
            found.append(pid)
    assert len(found) == 1, f"pid {ns_pid} under {root}: {found}"
    return found[0]


async def test_a_worker_in_its_own_pid_namespace_is_translated_frozen_and_resumed(
    hub: tuple[FakeHub, int], agents: AgentFactory, procs: list[subprocess.Popen[bytes]]
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", backend="freeze").start()
    await h.next_hello()
    # A host process whose pid the worker will have inside its namespace.
    victim = sleeper(procs)
    await asleep(victim.pid)
    worker = in_namespace([_worker(agent.socket, "job-ns")], pin_pid=victim.pid)
    await worker.start(expect_registered=False)
    try:
        assert (await worker.next_event())["kind"] == "SIBLING"
        event = await worker.next_event()
        assert event["kind"] == "REGISTERED", event
        mine = host_pid(worker.pid, victim.pid)
        assert mine != victim.pid and _nspid(mine)[-1] == victim.pid
        changed = await h.next_workers()
        assert [w.pid for w in changed.workers] == [mine]  # the node's pid, not the pod's
        await agent.wait_line(rf"pid {victim.pid} of the worker's pid namespace is pid {mine} ")
        async with StateSampler(victim.pid) as victim_states, StateSampler(mine) as states:
            ack = await h.execute(directive("n-1", CKPT, "job-ns", "grp", 1))
            assert ack.status == AckStatus.OK, ack.error
            assert process_state(mine) == "T"
            ack = await h.execute(directive("n-2", REST, "job-ns", "grp", 1))
            assert ack.status == AckStatus.OK, ack.error
            assert process_state(mine) in ("S", "R")
        assert "T" in states.states
        assert victim_states.states and set(victim_states.states) == {"S"}
    finally:
        await worker.kill()


async def test_in_a_namespace_only_descendants_register_and_the_refusals_are_counted(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", backend="freeze").start()
    await h.next_hello()
    sock = agent.socket
    worker = in_namespace(
        [
            _worker(sock, "job-nd", "--pid", "2"),  # the shell's sleep: no descendant of it
            _worker(sock, "job-nd", "--registrant-pid", "4242"),  # says it is someone else
            _worker(sock, "job-nd", "--child", "--registrant-pid", "0"),  # an older SDK
        ]
    )
    await worker.start(expect_registered=False)
    try:
        sibling = await worker.next_event()
        assert sibling == {"kind": "SIBLING", "pid": 2}, sibling
        refusal = await worker.next_event()
        assert (refusal["kind"], refusal["status"]) == ("ERROR", "PERMISSION_DENIED"), refusal
        assert "descendants in that namespace" in refusal["message"]
        refusal = await worker.next_event()
        assert (refusal["kind"], refusal["status"]) == ("ERROR", "PERMISSION_DENIED"), refusal
        assert "register from the process that connected" in refusal["message"]
        child = await worker.next_event()
        assert child["kind"] == "CHILD", child
        assert (await worker.next_event())["kind"] == "REGISTERED"
        child_host = host_pid(worker.pid, child["pid"])
        sibling_host = host_pid(worker.pid, 2)
        changed = await h.next_workers()
        assert [w.pid for w in changed.workers] == [child_host]
        host_two = process_state(2)  # whatever the node's pid 2 is, it is left alone
        ack = await h.execute(directive("nd-1", CKPT, "job-nd", "grp", 1))
        assert ack.status == AckStatus.OK, ack.error
        assert process_state(child_host) == "T"
        assert process_state(sibling_host) == "S"
        assert process_state(2) == host_two != "T"
        ack = await h.execute(directive("nd-2", REST, "job-nd", "grp", 1))
        assert ack.status == AckStatus.OK, ack.error
        assert process_state(child_host) in ("S", "R")
        for reason, count in (("not_descendant", 1), ("registrant_mismatch", 1), ("namespace", 0)):
            value = await agent.metric("timeslice_agent_registrations_refused_total", reason=reason)
            assert value == count, (reason, value)
    finally:
        await worker.kill()


# ----- a kernel without NSpid -----------------------------------------------------------------


def _fake_proc(root: Path, real: int, name: str, *, nspid: bool) -> None:
    """``root/<name>`` mirrors the real ``/proc/<real>`` files the checks read, NSpid optional."""
    d = root / name
    (d / "ns").mkdir(parents=True)
    status = Path(f"/proc/{real}/status").read_text().splitlines(keepends=True)
    (d / "status").write_text("".join(x for x in status if nspid or not x.startswith("NSpid:")))
    (d / "stat").write_text(Path(f"/proc/{real}/stat").read_text())
    (d / "ns" / "pid").symlink_to(os.readlink(f"/proc/{real}/ns/pid"))


def test_without_nspid_another_namespace_is_refused_with_the_reason(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    assert UNSHARE is not None
    outside = subprocess.Popen([UNSHARE, "--pid", "--kill-child", "sleep", "60"])
    procs.append(outside)

    pid = 0
    for _ in range(500):
        try:
            pid = host_pid(outside.pid, 1)
            break
        except AssertionError:
            time.sleep(0.01)
    assert pid and _nspid(pid)[-1] == 1
    peer = PeerCredentials(pid=pid, uid=os.geteuid(), gid=os.getegid())
    old = tmp_path / "old"
    _fake_proc(old, os.getpid(), "self", nspid=False)
    _fake_proc(old, pid, str(pid), nspid=False)
    with pytest.raises(RegistrationRefused, match="reports no NSpid") as refused:
        authorize_registration(peer, 1, "j1", own_pid=-1, proc=old)
    assert refused.value.reason == "namespace"
    assert isinstance(refused.value, PermissionDenied)
    # Without ns links either (Linux < 3.8), the SDK's registrant_pid still tells.
    (old / "self" / "ns" / "pid").unlink()
    with pytest.raises(RegistrationRefused, match="reports no NSpid"):
        authorize_registration(peer, 1, "j1", own_pid=-1, registrant_pid=1, proc=old)
    # With NSpid (this kernel's /proc): the namespace's pid 1 is that process.
    assert authorize_registration(peer, 1, "j1", own_pid=-1).pid == pid
    # A peer in the agent's namespace needs no NSpid: nothing to translate.
    me = PeerCredentials(pid=os.getpid(), uid=os.geteuid(), gid=os.getegid())
    same = tmp_path / "same"
    _fake_proc(same, os.getpid(), "self", nspid=False)
    _fake_proc(same, os.getpid(), str(os.getpid()), nspid=False)
    _fake_proc(same, outside.pid, str(outside.pid), nspid=False)
    assert authorize_registration(me, outside.pid, "j1", own_pid=-1, proc=same).pid == outside.pid


_SDK_WORKER = """
import json, os, sys, time
from timeslice.worker import register
registration = register("grp", job_id="job-sdk", socket=sys.argv[1], timeout=10)
print(json.dumps({"kind": "REGISTERED", "pid": os.getpid()}), flush=True)
time.sleep(60)
"""


async def test_the_sdk_registers_from_a_pid_namespace(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", backend="freeze").start()
    await h.next_hello()
    line = shlex.join([sys.executable, "-c", _SDK_WORKER, str(agent.socket)])
    worker = in_namespace([line])
    await worker.start(expect_registered=False)
    try:
        assert (await worker.next_event())["kind"] == "SIBLING"
        event = await worker.next_event()
        assert event["kind"] == "REGISTERED", event
        mine = host_pid(worker.pid, event["pid"])
        assert mine != event["pid"]
        changed = await h.next_workers()
        assert [w.pid for w in changed.workers] == [mine]
        await agent.wait_line(rf"worker registered: job job-sdk group grp pid {mine} ")
    finally:
        await worker.kill()


def test_a_walk_past_its_deadline_refuses_with_the_reason(
    procs: list[subprocess.Popen[bytes]],
) -> None:
    with pytest.raises(ProcWalkTimeout):
        descendants_of(os.getpid(), deadline=time.monotonic() - 1)
    assert UNSHARE is not None
    outside = subprocess.Popen([UNSHARE, "--pid", "--kill-child", "sh", "-c", "sleep 60"])
    procs.append(outside)
    pid = 0
    for _ in range(500):
        try:
            pid = host_pid(outside.pid, 1)
            break
        except AssertionError:
            time.sleep(0.01)
    peer = PeerCredentials(pid=pid, uid=os.geteuid(), gid=os.getegid())
    # Pid 2 there is not the peer: finding it needs the walk, which is out of time.
    with pytest.raises(RegistrationRefused) as refused:
        authorize_registration(peer, 2, "j1", own_pid=-1, deadline=time.monotonic() - 1)
    assert refused.value.reason == "timeout"
