"""The agent as a real process: the test plays the orchestrator, real workers register.

Everything crosses real sockets: the agent dials the test's AgentHub over loopback TCP, workers
are separate processes talking gRPC over the agent's unix socket, and the assertions read the
agent's /metrics, /readyz and state file.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from collections.abc import AsyncGenerator
from typing import cast

import pytest
from agent_harness import (
    AgentFactory,
    FakeHub,
    WorkerProcess,
    directive,
    eventually,
    running_hub,
)
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from timeslice.errors import ErrorKind
from timeslice.status_details import KIND_CODEC
from timeslice_agent.procs import process_state
from timeslice_proto.timeslice.v1 import (
    AckStatus,
    CommandResult,
    DirectiveKind,
    JobState,
    WorkerCommand,
    WorkerInfo,
    WorkerLinkStub,
)

CKPT = DirectiveKind.CHECKPOINT
REST = DirectiveKind.RESTORE
GB = 1_000_000_000


async def test_directives_fencing_idempotency_worker_exit_and_restart(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = agents(f"127.0.0.1:{port}", extra=["--sim-bandwidth-gbps", "20"])
    await agent.start()
    hello = await h.next_hello()
    assert (hello.node, hello.backend, hello.emulated) == ("node-a", "sim", True)
    assert [d.name for d in hello.devices] == ["sim-device (emulated)"]
    assert hello.devices[0].memory_bytes == 80 * GB
    assert hello.workers == [] and hello.epochs == [] and hello.agent_version
    assert await agent.http("/readyz") == (200, "ready\n")
    assert (await agent.http("/healthz"))[0] == 200

    worker = await WorkerProcess(
        agent.socket, "job-1", "grp-1", "--state-bytes", str(2 * GB)
    ).start()
    changed = await h.next_workers()
    assert [(w.job_id, w.group_id, w.pid, w.state_bytes) for w in changed.workers] == [
        ("job-1", "grp-1", worker.pid, 2 * GB)
    ]
    assert await agent.metric("timeslice_agent_registered_workers") == 1

    ckpt = await h.execute(directive("d-1", CKPT, "job-1", "grp-1", 5))
    assert (ckpt.status, ckpt.bytes_moved, ckpt.emulated, ckpt.job_state) == (
        AckStatus.OK,
        2 * GB,
        True,
        JobState.SAVED,
    )
    assert (ckpt.group_id, ckpt.epoch) == ("grp-1", 5)
    assert 0.08 <= ckpt.elapsed_seconds < 1.0  # 2 GB at 20 GB/s, modelled
    rest = await h.execute(directive("d-2", REST, "job-1", "grp-1", 5))
    assert (rest.status, rest.bytes_moved, rest.job_state) == (
        AckStatus.OK,
        2 * GB,
        JobState.RUNNING,
    )

    stale = await h.execute(directive("d-3", CKPT, "job-1", "grp-1", 4))
    assert stale.status == AckStatus.STALE_EPOCH and "stale epoch 4" in stale.error
    assert await agent.metric("timeslice_agent_directives_refused_total", reason="stale_epoch") == 1
    assert await agent.metric("timeslice_agent_jobs", state="running") == 1

    again = await h.execute(directive("d-1", CKPT, "job-1", "grp-1", 5))
    assert bytes(again) == bytes(ckpt)  # the stored ack: same timestamps, same bytes
    assert (
        await agent.metric("timeslice_agent_directives_total", kind="checkpoint", status="ok") == 1
    )
    assert (
        await agent.metric(
            "timeslice_agent_bytes_moved_total", kind="checkpoint", backend="sim", emulated="true"
        )
        == 2 * GB
    )

    await worker.kill()
    gone = await h.next_workers()
    assert gone.workers == []

    assert await agent.stop() == 0
    assert not agent.socket.exists()
    state = json.loads(agent.state_file.read_text())
    assert state["epochs"] == {"grp-1": 5}

    restarted = await agents(f"127.0.0.1:{port}").start()
    hello = await h.next_hello()
    assert [(e.group_id, e.epoch) for e in hello.epochs] == [("grp-1", 5)]
    # Fencing survived the restart, and so did the memory of acks.
    older = await h.execute(directive("d-4", REST, "job-1", "grp-1", 3))
    assert older.status == AckStatus.STALE_EPOCH
    assert bytes(await h.execute(directive("d-2", REST, "job-1", "grp-1", 5))) == bytes(rest)
    assert await restarted.stop() == 0


async def test_app_callback_hooks_round_trip_and_failure(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", extra=["--sim-time-scale", "0"]).start()
    await h.next_hello()
    good = await WorkerProcess(
        agent.socket, "job-ok", "grp", "--state-bytes", str(GB), "--app-callbacks",
        "--hook-bytes", "4096",
    ).start()  # fmt: skip
    await h.next_workers()
    ack = await h.execute(directive("c-1", CKPT, "job-ok", "grp", 1))
    event = await good.next_event()
    assert (event["kind"], event["job_id"], event["group_id"]) == (
        "BEFORE_CHECKPOINT",
        "job-ok",
        "grp",
    )
    assert (ack.status, ack.bytes_moved) == (AckStatus.OK, GB + 4096)
    ack = await h.execute(directive("c-2", REST, "job-ok", "grp", 1))
    assert (await good.next_event())["kind"] == "AFTER_RESTORE"
    assert (ack.status, ack.bytes_moved, ack.job_state) == (
        AckStatus.OK,
        GB + 4096,
        JobState.RUNNING,
    )

    bad = await WorkerProcess(
        agent.socket, "job-bad", "grp", "--app-callbacks", "--hook-mode", "fail"
    ).start()
    await h.next_workers()
    ack = await h.execute(directive("c-3", CKPT, "job-bad", "grp", 1))
    assert ack.status == AckStatus.FAILED
    assert "before_checkpoint hook exploded" in ack.error
    assert ack.job_state == JobState.FAULTED and ack.bytes_moved == 0
    assert await agent.metric("timeslice_agent_jobs", state="faulted") == 1
    await good.kill()
    await bad.kill()


async def test_registration_is_validated_and_lives_with_the_stream(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}").start()
    await h.next_hello()
    channel = Channel(path=str(agent.socket), status_details_codec=KIND_CODEC)
    stub = WorkerLinkStub(channel)
    try:
        for info in (
            WorkerInfo(job_id="../x", group_id="g", pid=1234),
            WorkerInfo(job_id="j", group_id="", pid=1234),
            WorkerInfo(job_id="j", group_id="g", pid=0),
        ):
            with pytest.raises(GRPCError) as err:
                async for _ in stub.register(info, timeout=5):
                    pass
            assert err.value.status == Status.INVALID_ARGUMENT
            assert err.value.details is ErrorKind.INVALID_ARGUMENT, err.value
            assert err.value.message and not err.value.message.startswith("[")
        with pytest.raises(GRPCError) as err:
            await stub.complete_command(CommandResult(command_id="nope", ok=True), timeout=5)
        assert err.value.status == Status.NOT_FOUND

        # A registration from this test process: it lasts exactly as long as the stream.
        async with asyncio.timeout(10):
            # The generated stub says AsyncIterator; the call returns an async generator.
            commands = cast(
                AsyncGenerator[WorkerCommand, None],
                stub.register(WorkerInfo(job_id="j", group_id="g", pid=os.getpid())),
            )
            first = await anext(commands)
            assert first.kind.name == "REGISTERED"
            changed = await h.next_workers()
            assert [w.pid for w in changed.workers] == [os.getpid()]
            await commands.aclose()
            assert (await h.next_workers()).workers == []
    finally:
        channel.close()
    assert await agent.metric("timeslice_agent_registered_workers") == 0


async def _registered(stub: WorkerLinkStub) -> AsyncGenerator[WorkerCommand, None]:
    # The generated stub says AsyncIterator; the call returns an async generator.
    return cast(
        AsyncGenerator[WorkerCommand, None],
        stub.register(WorkerInfo(job_id="j", group_id="g", pid=os.getpid())),
    )


async def test_a_registration_returns_once_the_orchestrator_recorded_it(
    agents: AgentFactory,
) -> None:
    """A worker may acquire as soon as it is registered: the orchestrator must know of it
    by then, or it plans that grant without the worker's device state."""
    async with running_hub(records_workers=True) as (h, port):
        agent = await agents(f"127.0.0.1:{port}").start()
        await h.next_hello()
        channel = Channel(path=str(agent.socket))
        try:
            commands = await _registered(WorkerLinkStub(channel))
            first = asyncio.ensure_future(anext(commands))
            changed = await h.next_workers()
            assert [w.pid for w in changed.workers] == [os.getpid()] and changed.seq > 0
            await asyncio.sleep(0.5)
            assert not first.done()  # not before the orchestrator has it
            h.record(changed.seq)
            assert (await asyncio.wait_for(first, 5)).kind.name == "REGISTERED"
            await commands.aclose()
        finally:
            channel.close()


async def test_a_registration_does_not_wait_for_an_orchestrator_that_never_confirms(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    """A replica older than WorkersRecorded (its Welcome does not offer it): at once."""
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}").start()
    await h.next_hello()
    channel = Channel(path=str(agent.socket))
    try:
        commands = await _registered(WorkerLinkStub(channel))
        first = await asyncio.wait_for(anext(commands), 2.5)
        assert first.kind.name == "REGISTERED"
        await commands.aclose()
    finally:
        channel.close()


async def test_freeze_backend_stops_worker_process_and_refuses_acquirer(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", backend="freeze").start()
    hello = await h.next_hello()
    assert (hello.backend, hello.emulated, list(hello.devices)) == ("freeze", False, [])
    worker = await WorkerProcess(agent.socket, "job-f", "grp").start()
    await h.next_workers()
    ack = await h.execute(directive("f-1", CKPT, "job-f", "grp", 1))
    assert (ack.status, ack.bytes_moved, ack.emulated) == (AckStatus.OK, 0, False)
    assert process_state(worker.pid) == "T"
    ack = await h.execute(directive("f-2", REST, "job-f", "grp", 1))
    assert ack.status == AckStatus.OK
    assert process_state(worker.pid) in ("S", "R")

    acquirer = await WorkerProcess(agent.socket, "job-a", "grp", "--acquirer").start()
    await h.next_workers()
    ack = await h.execute(directive("f-3", CKPT, "job-a", "grp", 1))
    assert ack.status == AckStatus.REFUSED and "acquirer" in ack.error
    assert process_state(acquirer.pid) in ("S", "R")
    assert ack.job_state == JobState.IDLE
    await worker.kill()
    await acquirer.kill()


async def test_reconnects_across_targets_and_readiness_follows_the_stream(
    agents: AgentFactory,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    async with running_hub() as (h, port):
        agent = agents(f"127.0.0.1:{dead_port},127.0.0.1:{port}")
        await agent.start()  # the first target refuses; the second one welcomes
        await h.next_hello()
        assert await agent.metric("timeslice_agent_stream_connected") == 1

    # The hub is gone: the agent keeps serving but is not ready.
    async def unready() -> bool:
        return (await agent.http("/readyz"))[0] == 503

    async def ready() -> bool:
        return (await agent.http("/readyz"))[0] == 200

    await eventually(unready, what="/readyz 503")
    assert (await agent.http("/healthz"))[0] == 200
    async with running_hub(port) as (h2, _):
        hello = await h2.next_hello()
        assert hello.node == "node-a"
        await eventually(ready, what="/readyz 200")
    assert (await agent.metric("timeslice_agent_stream_reconnects_total") or 0) >= 1
    assert await agent.stop(signal.SIGINT) == 0


async def test_stale_socket_and_corrupt_state_file_at_start(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    first = agents(f"127.0.0.1:{port}")
    first.state_file.write_text('{"version": 1, "node": "node-a", "epochs": [')
    # A socket file left by a crashed agent: bound, never unlinked, nobody listening.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(first.socket))
    stale.close()
    assert first.socket.exists()
    await first.start()
    assert (await h.next_hello()).epochs == []
    await first.wait_line("state file .* is corrupt")
    assert first.state_file.with_name(first.state_file.name + ".corrupt").exists()
    assert json.loads(first.state_file.read_text())["node"] == "node-a"  # rewritten, valid
    second = agents(f"127.0.0.1:{port}", node="node-b", socket=first.socket)
    code, err = await second.run_to_exit()
    assert code == 2
    assert "another process is serving the worker socket" in err
    assert not second.state_file.exists()  # it touched nothing
    assert first.socket.exists()
    assert await first.stop() == 0


async def test_ack_survives_a_reconnect_and_hello_reports_jobs(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", extra=["--sim-bandwidth-gbps", "2"]).start()
    await h.next_hello()
    worker = await WorkerProcess(agent.socket, "job-r", "grp", "--state-bytes", str(GB)).start()
    await h.next_workers()
    h.send(directive("r-1", CKPT, "job-r", "grp", 2))  # 0.5 s of modelled transfer
    await asyncio.sleep(0.1)
    await h.end_streams()  # the replica drops the stream mid-directive
    hello = await h.next_hello()  # the agent is back (same hub, new stream)
    assert [w.job_id for w in hello.workers] == ["job-r"]
    ack = await h.ack_for("r-1")  # finished after its stream was dropped, sent on the new one
    assert (ack.status, ack.bytes_moved) == (AckStatus.OK, GB)
    await agent.wait_line(r"orchestrator stream to \S+ failed")
    await h.end_streams()
    hello = await h.next_hello()
    assert [(j.job_id, j.group_id, j.state, j.saved_bytes) for j in hello.jobs] == [
        ("job-r", "grp", JobState.SAVED, GB)
    ]
    await worker.kill()


async def test_state_file_of_another_node_is_refused_untouched(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    _, port = hub
    agent = agents(f"127.0.0.1:{port}")
    foreign = '{"version": 1, "node": "node-x", "epochs": {"g": 9}}'
    agent.state_file.write_text(foreign)
    code, err = await agent.run_to_exit()
    assert code == 2
    assert "belongs to node 'node-x'" in err
    assert agent.state_file.read_text() == foreign
    assert not agent.socket.exists()
