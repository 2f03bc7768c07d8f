"""A job pod's program for the deployment start tests: two jobs share one group through the
deployment's orchestrators and agents, so a real switch runs.

Run inside a pod (tests.deploy.pods) whose hosts file names the deployment's Services. It
reads its settings from the environment, like a job's container would:

- ``TIMESLICE_TARGET``: the orchestrators, by the names the manifests give them;
- ``TIMESLICE_TLS_CA`` and, per job, ``JOB_<N>_TLS_CERT`` / ``JOB_<N>_TLS_KEY``;
- ``JOB_IDS`` (two, comma-separated), ``GROUP``, ``AGENT_SOCKETS`` (comma-separated: the
  agents' worker sockets, one per node of the group), ``RESULT`` (a JSON file to write).

Each job has a worker process (a sleeper) registered on every agent socket. Job 1 acquires
and yields (lazily: it stays resident), then job 2 acquires: the agents checkpoint job 1's
workers and restore job 2's. The result records who is resident on each node after each
step, and job 1's worker's process state after the switch (``T``: frozen by the freeze
backend).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from timeslice import AsyncTimeSliceClient, register


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


async def run() -> dict[str, Any]:
    jobs = os.environ["JOB_IDS"].split(",")
    group = os.environ["GROUP"]
    sockets = os.environ["AGENT_SOCKETS"].split(",")
    ca = os.environ["TIMESLICE_TLS_CA"]
    sleepers = {job: subprocess.Popen(["sleep", "600"]) for job in jobs}
    registrations = [
        register(group, job_id=job, pid=sleepers[job].pid, socket=sock, state_bytes=1 << 20)
        for job in jobs
        for sock in sockets
    ]
    result: dict[str, Any] = {"target": os.environ["TIMESLICE_TARGET"], "steps": []}
    try:
        for index, job in enumerate(jobs):
            client = AsyncTimeSliceClient(
                job_id=job,
                tls_ca=ca,
                tls_cert=os.environ[f"JOB_{index}_TLS_CERT"],
                tls_key=os.environ[f"JOB_{index}_TLS_KEY"],
                call_timeout=20,
            )
            async with client:
                grant = await client.acquire(group, timeout=60)
                status = await client.status(group)
                result["steps"].append(
                    {
                        "job": job,
                        "granted": grant.job_id,
                        "holder": status.holder_job_id,
                        "resident": {n.node: n.resident_job_id for n in status.nodes},
                        "worker_states": {j: _state(p.pid) for j, p in sleepers.items()},
                    }
                )
                await client.yield_(group)
    finally:
        for registration in registrations:
            registration.close()
        for proc in sleepers.values():
            proc.kill()
            proc.wait()
    return result


def main() -> None:
    result = asyncio.run(run())
    Path(os.environ["RESULT"]).write_text(json.dumps(result, indent=1))
    print(json.dumps(result), file=sys.stderr)


if __name__ == "__main__":
    main()
