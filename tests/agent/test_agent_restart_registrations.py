"""A restarted agent says hello once its jobs' workers have registered again (issue 37, 8).

A real freeze agent, killed with SIGKILL and started again on its state file; the test plays
the orchestrator, a real worker process registers through the SDK (whose registration
reconnects on its own). Before, the hello went out before the registration came back: the
node's record listed no worker of the job, and a checkpoint of it stopped nothing (the agent
knows only registered processes), so the worker, registering a moment later, ran beside the
job given the devices.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from agent_harness import AgentFactory, FakeHub, directive, eventually

from timeslice import register
from timeslice_agent.procs import process_state
from timeslice_proto.timeslice.v1 import AckStatus, DirectiveKind

WORKER = "import time\nwhile True:\n    time.sleep(0.05)\n"


async def _persisted(state_file: Path, job: str) -> bool:
    try:
        state = json.loads(await asyncio.to_thread(state_file.read_text))
    except (OSError, ValueError):
        return False
    return job in state.get("jobs", {})


async def test_a_restarted_agent_says_hello_once_the_workers_registered_again(
    hub: tuple[FakeHub, int], agents: AgentFactory
) -> None:
    h, port = hub
    agent = await agents(f"127.0.0.1:{port}", backend="freeze").start()
    await h.next_hello()
    child = subprocess.Popen(
        [sys.executable, "-c", WORKER], env={**os.environ, "TIMESLICE_JOB_ID": "job-r"}
    )
    registration = await asyncio.to_thread(
        register, "grp", job_id="job-r", pid=child.pid, socket=str(agent.socket)
    )
    try:
        await h.next_workers()
        await eventually(
            lambda: _persisted(agent.state_file, "job-r"), what="job-r in the state file"
        )
        await agent.stop(signal.SIGKILL)

        restarted = await agents(f"127.0.0.1:{port}", backend="freeze").start()
        hello = await h.next_hello()
        # The job is in the state file, on the devices: its worker is back before the hello.
        assert [(w.job_id, w.pid) for w in hello.workers] == [("job-r", child.pid)], hello
        assert "job-r" in [j.job_id for j in hello.jobs]
        ack = await h.execute(directive("r-1", DirectiveKind.CHECKPOINT, "job-r", "grp", 1))
        assert ack.status == AckStatus.OK, ack
        assert process_state(child.pid) == "T"  # the checkpoint stopped the worker
        ack = await h.execute(directive("r-2", DirectiveKind.RESTORE, "job-r", "grp", 1))
        assert ack.status == AckStatus.OK, ack
        assert process_state(child.pid) in ("S", "R")
        assert await restarted.stop() == 0
    finally:
        registration.close()
        child.kill()
        child.wait()
