"""A job moves to another group on a node once nothing of it is left in the old one (issue 13,
finding 5): a real agent process, real worker processes, the test playing the orchestrator.

The agent used to keep a job bound to its first group for as long as it remembered the job, and
it remembers a job whose state it parked on the host even after every worker of it closed:
"job job-a is in group grp-1 on this node" forever. Now a job is bound while a worker, a
directive or a parked checkpoint of live processes is there; a checkpoint whose processes are
gone is discarded when the job comes back in another group.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import cast

import pytest
from agent_harness import AgentFactory, FakeHub, WorkerProcess, directive
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError
from test_agent_executor import CKPT, Rig

from timeslice.errors import InvalidArgument
from timeslice_agent.jobs import Job, Residency
from timeslice_agent.jobs import JobState as AgentJobState
from timeslice_agent.statefile import AgentState
from timeslice_proto.timeslice.v1 import (
    AckStatus,
    DirectiveKind,
    JobState,
    WorkerCommand,
    WorkerInfo,
    WorkerLinkStub,
)

REST = DirectiveKind.RESTORE
GB = 1_000_000_000
FAST = ["--sim-time-scale", "0"]


def jobs_in(state_file: str) -> dict[str, tuple[str, str]]:
    """The job table of the agent's state file: job -> (group, state)."""
    with open(state_file) as f:
        jobs = json.load(f)["jobs"]
    return {job: (rec["group"], rec["state"]) for job, rec in jobs.items()}


async def test_a_job_moves_group_once_its_workers_on_the_node_are_gone(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", extra=FAST).start()
    await h.next_hello()
    old = await WorkerProcess(agent.socket, "job-a", "grp-1", "--state-bytes", str(GB)).start()
    await h.next_workers()
    parked = await h.execute(directive("d-1", CKPT, "job-a", "grp-1", 5))
    assert (parked.status, parked.job_state, parked.bytes_moved) == (
        AckStatus.OK,
        JobState.SAVED,
        GB,
    )

    # While its worker lives, the job stays in grp-1.
    early = await WorkerProcess(agent.socket, "job-a", "grp-2").start(expect_registered=False)
    refused = await early.next_event()
    assert (refused["kind"], refused["status"]) == ("ERROR", "INVALID_ARGUMENT")
    assert "grp-1" in refused["message"]

    # Its worker ends: the checkpoint parked for grp-1 belongs to a process that is gone.
    await old.kill()
    assert (await h.workers_until(lambda c: not c.workers)).workers == []
    assert jobs_in(str(agent.state_file))["job-a"] == ("grp-1", "saved")

    new = await WorkerProcess(agent.socket, "job-a", "grp-2", "--state-bytes", str(2 * GB)).start()
    changed = await h.workers_until(lambda c: bool(c.workers))
    assert [(w.job_id, w.group_id, w.pid) for w in changed.workers] == [("job-a", "grp-2", new.pid)]
    # The old group's late directives find nothing of the job there (and touch nothing of its
    # new group); its own group's directives move its state.
    late = await h.execute(directive("d-2", REST, "job-a", "grp-1", 5))
    assert (late.status, late.bytes_moved, late.job_state) == (
        AckStatus.OK,
        0,
        JobState.UNSPECIFIED,
    )
    evict = await h.execute(directive("d-2b", CKPT, "job-a", "grp-1", 6))
    assert (evict.status, evict.bytes_moved) == (AckStatus.OK, 0)
    ckpt = await h.execute(directive("d-3", CKPT, "job-a", "grp-2", 1))
    assert (ckpt.status, ckpt.job_state, ckpt.bytes_moved) == (AckStatus.OK, JobState.SAVED, 2 * GB)
    rest = await h.execute(directive("d-4", REST, "job-a", "grp-2", 1))
    assert (rest.status, rest.job_state, rest.bytes_moved) == (
        AckStatus.OK,
        JobState.RUNNING,
        2 * GB,
    )
    assert jobs_in(str(agent.state_file))["job-a"] == ("grp-2", "running")
    # Fencing of the old group is kept: a stale epoch there is still stale.
    assert json.loads(agent.state_file.read_text())["epochs"] == {"grp-1": 6, "grp-2": 1}
    # The common case: the job's state on the device, its worker ends (the agent forgets the
    # job), it comes back in grp-1; grp-2, which still counts it resident, evicts it late.
    await new.kill()
    await h.workers_until(lambda c: not c.workers)
    back = await WorkerProcess(agent.socket, "job-a", "grp-1").start()
    await h.workers_until(lambda c: bool(c.workers))
    evict = await h.execute(directive("d-5", CKPT, "job-a", "grp-2", 2))
    assert (evict.status, evict.bytes_moved) == (AckStatus.OK, 0)
    # A group the job was never in here is still the orchestrator's mistake.
    wrong = await h.execute(directive("d-6", CKPT, "job-a", "grp-9", 1))
    assert wrong.status == AckStatus.REFUSED and "grp-1" in wrong.error
    await back.kill()
    await early.kill()
    assert await agent.stop() == 0


async def test_a_checkpoint_parked_for_a_live_process_keeps_the_job_in_its_group(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    # The registration closes but its process (this test's) lives on with its state parked:
    # moving the job would strand that state, so the job stays until it is restored.
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", extra=FAST).start()
    await h.next_hello()
    channel = Channel(path=str(agent.socket))
    stub = WorkerLinkStub(channel)
    try:
        async with asyncio.timeout(10):
            commands = cast(
                AsyncGenerator[WorkerCommand, None],
                stub.register(
                    WorkerInfo(job_id="job-b", group_id="grp-1", pid=os.getpid(), state_bytes=GB)
                ),
            )
            assert (await anext(commands)).kind.name == "REGISTERED"
            await h.workers_until(lambda c: bool(c.workers))
            parked = await h.execute(directive("p-1", CKPT, "job-b", "grp-1", 3))
            assert parked.job_state == JobState.SAVED
            await commands.aclose()
            await h.workers_until(lambda c: not c.workers)

            moved = WorkerInfo(job_id="job-b", group_id="grp-2", pid=os.getpid())
            with pytest.raises(GRPCError) as refused:
                async for _ in stub.register(moved, timeout=5):
                    pass
            assert refused.value.status == Status.INVALID_ARGUMENT
            message = refused.value.message or ""
            assert "parked" in message
            assert str(os.getpid()) in message

            # Restored (its state back on the device) with no worker left, the job is
            # forgotten, and then it may move.
            rest = await h.execute(directive("p-2", REST, "job-b", "grp-1", 3))
            assert rest.status == AckStatus.OK  # and the job, with no worker, forgotten
            again = cast(AsyncGenerator[WorkerCommand, None], stub.register(moved))
            assert (await anext(again)).kind.name == "REGISTERED"
            changed = await h.workers_until(lambda c: bool(c.workers))
            assert [(w.job_id, w.group_id) for w in changed.workers] == [("job-b", "grp-2")]
            await again.aclose()
    finally:
        channel.close()
    assert await agent.stop() == 0


async def test_what_an_agent_restart_left_of_a_job_does_not_keep_it_in_its_group(
    tmp_path: Path,
) -> None:
    # A previous run left the job on the device, and another parked for a process that has
    # since exited; neither has a worker now. A job with a directive running stays put.
    dead = await asyncio.create_subprocess_exec("true")
    await dead.wait()
    rig = Rig(tmp_path)
    try:
        await rig.executor.adopt(
            AgentState(
                node="n1",
                epochs={"g1": 4},
                jobs={
                    "on-device": Job("on-device", "g1", AgentJobState.RUNNING),
                    "parked": Job(
                        "parked", "g1", AgentJobState.SAVED, Residency.HOST, "", GB, (dead.pid,)
                    ),
                    "busy": Job("busy", "g1", AgentJobState.RUNNING),
                    "mover": Job("mover", "g1", AgentJobState.RUNNING),
                },
            )
        )
        rig.worker("on-device", "g2")
        rig.worker("parked", "g2")
        assert {j: (job.group_id, job.state) for j, job in rig.executor.jobs.items()} == {
            "on-device": ("g2", AgentJobState.IDLE),
            "parked": ("g2", AgentJobState.IDLE),
            "busy": ("g1", AgentJobState.RUNNING),
            "mover": ("g1", AgentJobState.RUNNING),
        }
        assert rig.executor.epochs == {"g1": 4}
        # A directive of the old group accepted, and the job moves before it starts: when it
        # starts it must not touch the job's processes in the new group.
        rig.send("m-1", CKPT, "mover", 5)
        rig.worker("mover", "g2")
        late = await rig.ack()
        assert (late.status, late.bytes_moved) == (AckStatus.OK, 0)
        assert rig.executor.jobs["mover"].state is AgentJobState.IDLE
        busy = rig.worker("busy", "g1", gb=40)
        rig.send("b-1", CKPT, "busy", 5)  # 40 GB at 10 GB/s: running for a while
        async with asyncio.timeout(5):
            while rig.executor.jobs["busy"].state is not AgentJobState.TRANSITIONING:
                await asyncio.sleep(0.01)
        rig.registry.unregister(busy, "closed")
        with pytest.raises(InvalidArgument, match="in progress"):
            rig.worker("busy", "g2")
        assert (await rig.ack(timeout=10)).status == AckStatus.OK
        # Parked for this test's own (live) process now: still bound.
        with pytest.raises(InvalidArgument, match="parked"):
            rig.worker("busy", "g2")
    finally:
        await rig.close()
