"""One pod of k8s/examples/shared-gpus, as the deployment test runs it: the container's own
environment (job and group from the pod's labels by the downward API, the orchestrator
Service, the job's certificate, the agent's socket), with this program as its command.

It registers a worker process (a sleeper) for its job and group with the node's agent, then
acquires the group, records who is resident, yields (lazily: it stays resident until another
job wants the group) and writes ``RESULT``. It keeps its worker registered until ``DONE``
exists, as a job between two phases would, so that the other job's acquire must switch.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from timeslice import AsyncTimeSliceClient, register


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


async def acquire_and_yield(job: str, group: str, worker: int) -> dict[str, Any]:
    # Target, job id and certificate from the container's environment, as a job's are.
    async with AsyncTimeSliceClient(call_timeout=20) as client:
        grant = await client.acquire(group, timeout=60)
        status = await client.status(group)
        await client.yield_(group)
    return {
        "job": job,
        "group": group,
        "granted": grant.job_id,
        "resident": {n.node: n.resident_job_id for n in status.nodes},
        "worker": worker,
    }


def main() -> None:
    job = os.environ["TIMESLICE_JOB_ID"]
    group = os.environ["TIMESLICE_GROUP"]
    sleeper = subprocess.Popen(["sleep", "600"])
    registration = register(
        group,
        job_id=job,
        pid=sleeper.pid,
        socket=os.environ["TIMESLICE_AGENT_SOCKET"],
        state_bytes=1 << 20,
    )
    try:
        result = asyncio.run(acquire_and_yield(job, group, sleeper.pid))
        Path(os.environ["RESULT"]).write_text(json.dumps(result))
        done = Path(os.environ["DONE"])
        deadline = time.monotonic() + 120
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        result["worker_state_at_end"] = _state(sleeper.pid)
        print(json.dumps(result))
    finally:
        registration.close()
        sleeper.kill()
        sleeper.wait()


if __name__ == "__main__":
    main()
