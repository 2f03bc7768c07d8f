"""The agent's llm-d snapshot agent API (``--llmd-port``) against real agents and orchestrators.

The workload and the operator calls are subprocesses with synchronous ``grpcio`` and code
generated at test time from the repository's own protos (grpcio-tools), as the reference's
client is: what is tested is the wire contract, not our betterproto2 code.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient
from timeslice_agent.journal import read_journal
from timeslice_agent.llmd import holders_of, loopback_peer, socket_inode
from timeslice_agent.peers import RegistrationRefused
from timeslice_tools.dev import _procs

ROOT = Path(__file__).resolve().parents[2]
CLIENT = Path(__file__).with_name("llmd_client.py")
GROUP = "g-llmd"
SWITCHES = 10
HAS_GPU = Path("/dev/nvidia0").exists()


@pytest.fixture(scope="module")
def gen(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """grpcio code generated from our own copy of the protos."""
    out = tmp_path_factory.mktemp("llmd-gen")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{ROOT / 'protos'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            "snapshot_agent/v1alpha1/agent.proto",
            "grpc/health/v1/health.proto",
        ],
        check=True,
        capture_output=True,
    )
    return out


def _calls(gen: Path, target: str, calls: list[Any]) -> list[Any]:
    proc = subprocess.run(
        [sys.executable, str(CLIENT), "calls", str(gen), target, json.dumps(calls)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: list[Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _workload(gen: Path, target: str, job: str, log: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(CLIENT), "workload", str(gen), target, job, GROUP, str(log), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _commands(log: Path) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


@pytest.fixture
def workloads() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        proc.kill()
        proc.wait()


async def _wait_registered(gen: Path, target: str, jobs: set[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        [[code, status]] = await asyncio.to_thread(_calls, gen, target, [["Status"]])
        if code == "OK" and jobs <= status["jobs"].keys():
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"workloads {jobs} never showed up in Status")


async def _wait_queued(client: AsyncTimeSliceClient) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not (await client.status(GROUP)).queue:
        await asyncio.sleep(0.01)


async def test_workload_channel_gets_a_command_at_every_switch(
    cluster_factory: ClusterFactory,
    gen: Path,
    tmp_path: Path,
    workloads: list[subprocess.Popen[str]],
) -> None:
    (port,) = _procs.free_ports(1)
    cluster = cluster_factory(tls=False, backend="app", agent_args=["--llmd-port", str(port)])
    target = f"127.0.0.1:{port}"
    logs = {job: tmp_path / f"{job}.jsonl" for job in ("job-a", "job-b")}
    # job-a: DISCARD with tags, and its first snapshot answered late (the ABORTED window);
    # job-b: no capabilities, so OFFLOAD and no tags.
    workloads.append(
        # 10 s: the operator's own process must start and poll within that window.
        _workload(gen, target, "job-a", logs["job-a"], "SUSPEND_MODE_DISCARD", "w1,w2", "10")
    )
    workloads.append(_workload(gen, target, "job-b", logs["job-b"]))
    await _wait_registered(gen, target, {"job-a", "job-b"})
    await asyncio.sleep(0.5)  # the agent's WorkersChanged reaches the orchestrator

    async with (
        AsyncTimeSliceClient(cluster.target, job_id="job-a", insecure=True) as a,
        AsyncTimeSliceClient(cluster.target, job_id="job-b", insecure=True) as b,
    ):
        clients = {"job-a": a, "job-b": b}
        await a.acquire(GROUP, timeout=60)
        holder, other = "job-a", "job-b"
        for i in range(SWITCHES):
            waiter = asyncio.create_task(clients[other].acquire(GROUP, timeout=90))
            await _wait_queued(clients[holder])
            operator = None
            if i == 0:
                # While job-a's checkpoint waits for its workload, it is TRANSITIONING.
                operator = asyncio.create_task(
                    asyncio.to_thread(
                        _calls,
                        gen,
                        target,
                        [
                            ["wait_state", {"job": "job-a", "state": "JOB_STATE_TRANSITIONING"}],
                            ["Snapshot", {"job_id": "job-a", "group": GROUP}],
                            ["Restore", {"job_id": "job-a", "group": GROUP}],
                        ],
                    )
                )
                await asyncio.sleep(1.0)  # the subprocess is up and polling
            await clients[holder].yield_(GROUP)
            grant = await waiter
            if operator is not None:
                waited, snap, rest = await operator
                assert waited[1]["job-a"] == "JOB_STATE_TRANSITIONING", waited
                assert snap[0] == "ABORTED" and rest[0] == "ABORTED", (snap, rest)
            if i == 1:
                assert grant.restored
                # job-a RUNNING (just restored), job-b SAVED: operator moves are refused,
                # typed, and nothing changes.
                results = await asyncio.to_thread(
                    _calls,
                    gen,
                    target,
                    [
                        ["Snapshot", {"job_id": "job-b"}],  # SAVED: needs RUNNING
                        ["Restore", {"job_id": "job-a"}],  # RUNNING: needs SAVED
                        ["Snapshot", {"job_id": "job-a", "group": GROUP}],  # refused: fencing
                        ["Restore", {"job_id": "job-b", "group": GROUP}],  # refused: fencing
                        ["Snapshot", {"job_id": "job-nobody"}],
                        ["GetOperation", {"id": "op-1"}],
                        ["Status"],
                    ],
                )
                codes = [r[0] for r in results]
                assert codes[:6] == ["FAILED_PRECONDITION"] * 4 + ["NOT_FOUND"] * 2, results
                assert "needs the job RUNNING" in results[0][1]
                assert "needs the job SAVED" in results[1][1]
                assert "orchestrator" in results[2][1] and "orchestrator" in results[3][1]
                status = results[6][1]
                assert status["jobs"]["job-a"] == "JOB_STATE_RUNNING", status
                assert status["jobs"]["job-b"] == "JOB_STATE_SAVED", status
            holder, other = other, holder
        # The last restore's command was answered (and logged) before the grant.
        commands = {job: _commands(log) for job, log in logs.items()}

    entries = read_journal(cluster.agent_journals["node-0"])
    assert not [e for e in entries if e.status != "ok"], entries
    # Switch k (1-based) checkpoints job-a for odd k, job-b for even k, and restores the
    # other; job-b's first grant restores nothing (it never left the device).
    expected = {
        "job-a": ["snapshot", "restore"] * (SWITCHES // 2),
        "job-b": ["snapshot", "restore"] * (SWITCHES // 2 - 1) + ["snapshot"],
    }
    for job, got in commands.items():
        assert [c["kind"] for c in got] == expected[job], (job, got)
        mine = [e for e in entries if e.job == job]
        checkpoints = [e for e in mine if e.kind == "checkpoint"]
        restores = [
            e for e in mine if e.kind == "restore" and e.started_at > checkpoints[0].started_at
        ]
        snaps = [c for c in got if c["kind"] == "snapshot"]
        rests = [c for c in got if c["kind"] == "restore"]
        assert len(snaps) == len(checkpoints), (job, checkpoints)
        assert len(rests) == len(restores), (job, restores)
        # Each command arrived while its directive ran: before the checkpoint finished,
        # after the restore started.
        for cmd, entry in zip(snaps, sorted(checkpoints, key=lambda e: e.started_at), strict=True):
            assert entry.started_at - 0.5 <= cmd["t"] <= entry.finished_at + 0.5, (cmd, entry)
        for cmd, entry in zip(rests, sorted(restores, key=lambda e: e.started_at), strict=True):
            assert entry.started_at - 0.5 <= cmd["t"] <= entry.finished_at + 0.5, (cmd, entry)
        assert len({c["id"] for c in got}) == len(got)
    assert {
        (c["mode"], tuple(c["tags"])) for c in commands["job-a"] if c["kind"] == "snapshot"
    } == {("SUSPEND_MODE_DISCARD", ("w1", "w2"))}
    assert all(c["tags"] == ["w1", "w2"] for c in commands["job-a"] if c["kind"] == "restore")
    assert {
        (c["mode"], tuple(c["tags"])) for c in commands["job-b"] if c["kind"] == "snapshot"
    } == {("SUSPEND_MODE_OFFLOAD", ())}


async def test_bad_input_status_and_health(
    cluster_factory: ClusterFactory,
    gen: Path,
    tmp_path: Path,
    workloads: list[subprocess.Popen[str]],
) -> None:
    (port,) = _procs.free_ports(1)
    cluster = cluster_factory(tls=False, backend="app", agent_args=["--llmd-port", str(port)])
    target = f"127.0.0.1:{port}"
    workloads.append(_workload(gen, target, "job-a", tmp_path / "a.jsonl"))
    await _wait_registered(gen, target, {"job-a"})

    def register(job: str, group: str = GROUP, **caps: Any) -> dict[str, Any]:
        return {"register": {"job_id": job, "group": group, **caps}}

    channel_cases = [
        [{"result": "c1"}],  # first message not `register`
        [{}],  # neither register nor result
        [register("")],  # empty job id
        [register("../etc")],  # invalid job id
        [register("j" * 300)],  # oversized job id
        [register("job-c", "")],  # empty group
        [register("job-c"), register("job-c")],  # a second register
        [register("job-c"), {}],  # an empty message after register
        [register("job-a", "g-elsewhere")],  # job-a is registered in GROUP on this node
        [register("job-c", modes=["SUSPEND_MODE_OFFLOAD"], default="SUSPEND_MODE_DISCARD")],
    ]
    calls: list[Any] = [["Channel", {"messages": c}] for c in channel_cases]
    calls += [
        ["Snapshot", {"job_id": ""}],
        ["Snapshot", {"job_id": "x" * 300}],
        ["Restore", {"job_id": "job-a", "group": "../g"}],
        ["Snapshot", {"job_id": "job-a", "backend": 7}],  # a value the enum does not name
        ["Snapshot", {"job_id": "job-a", "pids": [-3]}],
        ["GetOperation", {"id": ""}],
        ["GetOperation", {"id": "o" * 1000}],
        ["GetOperation", {"id": "no-such-op"}],
        ["Snapshot", {"job_id": "job-a"}],  # IDLE (registered, nothing moved): not RUNNING
        ["Restore", {"job_id": "job-a"}],
        ["Health", {"service": ""}],
        ["Health", {"service": "app-channel"}],
        ["Health", {"service": "app"}],
        ["Health", {"service": "cuda"}],
        ["Health", {"service": "no-such-backend"}],
        ["Status"],
    ]
    results = await asyncio.to_thread(_calls, gen, target, calls)
    codes = [r[0] for r in results]
    n = len(channel_cases)
    assert codes[:n] == ["INVALID_ARGUMENT"] * n, list(zip(channel_cases, results[:n], strict=True))
    assert codes[n:] == [
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "INVALID_ARGUMENT",
        "NOT_FOUND",
        "FAILED_PRECONDITION",
        "FAILED_PRECONDITION",
        "OK",
        "OK",
        "OK",
        "OK",
        "OK",
        "OK",
    ], results[n:]
    health = [r[1] for r in results[n + 10 : n + 15]]
    assert health == ["SERVING", "SERVING", "SERVING", "NOT_SERVING", "NOT_SERVING"]
    status = results[-1][1]
    # Nothing changed: job-a is still the one registered job; no GPU here, no accelerators
    # (with NVML, one entry per device).
    assert status["jobs"] == {"job-a": "JOB_STATE_IDLE"}, status
    if not HAS_GPU:
        assert status["accelerators"] == []
    assert all(p.poll() is None for p in workloads)
    assert all(s.is_running() for s in cluster.services.values())


def test_loopback_peer_names_the_process_holding_the_client_end() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        conn, peer = server.accept()
        try:
            local = conn.getsockname()
            inode = socket_inode(peer, local)
            assert inode == os.fstat(client.fileno()).st_ino
            assert holders_of(inode) == [os.getpid()]
            creds = loopback_peer(peer, local)
            assert creds.pid == os.getpid() and creds.uid == os.geteuid()
            # Held by two processes: the registering one cannot be told, so refused.
            child = subprocess.Popen(["sleep", "30"], pass_fds=[client.fileno()])
            try:
                deadline = time.monotonic() + 5
                while len(holders_of(inode)) < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                with pytest.raises(RegistrationRefused, match="several processes"):
                    loopback_peer(peer, local)
            finally:
                child.kill()
                child.wait()
        finally:
            conn.close()
            client.close()
    with pytest.raises(RegistrationRefused, match="loopback"):
        loopback_peer(("10.1.2.3", 4000), ("10.1.2.4", 9001))
    with pytest.raises(RegistrationRefused, match="no socket"):
        loopback_peer(("127.0.0.1", 1), ("127.0.0.1", 2))


async def test_workload_results_complete_the_hooks_in_process() -> None:
    """ok=false fails the hook with the workload's error; ok=true completes it; a workload
    that goes away mid-hook fails it (the registry's own rules, over the TCP channel)."""
    from grpclib.client import Channel
    from grpclib.const import Cardinality

    from timeslice.wire import strict_server
    from timeslice_agent.llmd import SnapshotAgentService
    from timeslice_agent.workers import HookFailed, Moved, WorkerRegistry
    from timeslice_proto.snapshot_agent.v1alpha1 import (
        AgentCommand,
        CommandResult,
        RegisterWorkload,
        SuspendMode,
        WorkloadMessage,
    )
    from timeslice_proto.timeslice.v1 import HookKind

    registry = WorkerRegistry(on_change=lambda job: None)
    # The test process is the workload here: tell the service the agent is another pid.
    service = SnapshotAgentService(registry, dict, own_pid=1)
    server = strict_server([service])
    await server.start("127.0.0.1", 0)
    port = server._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    channel = Channel("127.0.0.1", port)
    method = "/snapshot_agent.v1alpha1.SnapshotAgentService/WorkloadChannel"
    try:
        async with channel.request(
            method, Cardinality.STREAM_STREAM, WorkloadMessage, AgentCommand
        ) as stream:
            await stream.send_message(
                WorkloadMessage(register=RegisterWorkload(job_id="j1", group="g1"))
            )
            deadline = time.monotonic() + 10
            while not registry.workers_of("j1") and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert [w.pid for w in registry.workers_of("j1")] == [os.getpid()]

            async def answer(ok: bool, error: str = "") -> AgentCommand:
                command = await stream.recv_message()
                assert command is not None
                await stream.send_message(
                    WorkloadMessage(
                        result=CommandResult(command_id=command.command_id, ok=ok, error=error)
                    )
                )
                return command

            hook = asyncio.create_task(
                registry.run_hooks("j1", "g1", HookKind.BEFORE_CHECKPOINT, 10)
            )
            command = await answer(False, "engine busy")
            assert command.snapshot is not None and command.snapshot.mode is SuspendMode.OFFLOAD
            with pytest.raises(HookFailed, match="engine busy"):
                await hook
            hook = asyncio.create_task(registry.run_hooks("j1", "g1", HookKind.AFTER_RESTORE, 10))
            command = await answer(True)
            assert command.restore is not None
            assert await hook == Moved()
            hook = asyncio.create_task(
                registry.run_hooks("j1", "g1", HookKind.BEFORE_CHECKPOINT, 10)
            )
            assert await stream.recv_message() is not None
            await stream.cancel()  # the workload goes away mid-hook
        with pytest.raises(HookFailed, match="went away"):
            await hook
        deadline = time.monotonic() + 10
        while registry.workers_of("j1") and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not registry.workers_of("j1")
    finally:
        channel.close()
        server.close()
        await server.wait_closed()


def test_llmd_flags() -> None:
    from timeslice_agent.config import parse_config

    base = ["--orchestrator", "127.0.0.1:1", "--insecure", "--node", "n1", "--backend", "sim"]
    config = parse_config(base, environ={})
    assert config.llmd_port is None and config.llmd_host == "127.0.0.1"
    config = parse_config([*base, "--llmd-port", "9001", "--llmd-host", "::1"], environ={})
    assert config.llmd_port == 9001 and config.llmd_host == "::1"
    for bad in ("-1", "65536", "x"):
        with pytest.raises(SystemExit):
            parse_config([*base, "--llmd-port", bad], environ={})
