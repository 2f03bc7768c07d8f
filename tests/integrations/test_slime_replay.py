"""Two Slime jobs replay Slime's phase sequence through the real callback on a real cluster.

Each job is its own process configured only by the callback's environment variables (TLS
from the suite's). Synchronous RL: both jobs share the trainer and the sampler group.
Asynchronous RL: they share only the trainer group. Checked: both finish (no deadlock,
whatever the interleaving), no two holds of a group overlap on the recorded history, and the
lock a job still held when it exited is given back at exit (well before its session expires).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient
from timeslice_tools.history import Hold, check_mutual_exclusion

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
SESSION_TTL = 10.0  # the SDK's default: a release at exit must come far sooner


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_two_slime_jobs_share_their_pools_without_overlap_or_deadlock(
    cluster_factory: ClusterFactory, tmp_path: Path, mode: str
) -> None:
    cluster = cluster_factory(agents=0)
    logs = {job: tmp_path / f"{job}.jsonl" for job in ("job-a", "job-b")}
    procs = []
    for job, log in logs.items():
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("libs", "services", ".")),
            "TIMESLICE_JOB_ID": job,
            "TIMESLICE_ORCH_ADDR": ",".join(cluster.targets),
            "TIMESLICE_TRAINER_GROUP": "trainer",
            "TIMESLICE_SAMPLER_GROUP": "sampler" if mode == "sync" else f"sampler-{job}",
            "TIMESLICE_ACQUIRE_TIMEOUT": "60",
        }
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.integrations.slime_job",
                mode,
                str(STEPS),
                str(log),
                env=env,
                cwd=ROOT,
                stderr=asyncio.subprocess.PIPE,
            )
        )
    try:
        async with asyncio.timeout(120):
            results = [await p.communicate() for p in procs]
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err.decode()[-3000:]
    exited_at = time.time()

    lines = [json.loads(line) for log in logs.values() for line in log.read_text().splitlines()]
    holds = [
        Hold(x["job"], x["group"], x["epoch"], x["ticket"], x["granted_at"], x["released_at"])
        for x in lines
        if "epoch" in x
    ]
    groups = {h.group for h in holds}
    shared = {"trainer", "sampler"} if mode == "sync" else {"trainer"}
    assert shared <= groups
    for group in shared:  # both jobs took turns on each shared group
        assert {h.job for h in holds if h.group == group} == {"job-a", "job-b"}, group
    # init + per step + the final train: every phase of both jobs got its locks.
    per_job = 1 + STEPS * (5 if mode == "sync" else 3) + (1 if mode == "async" else 0) + 1
    assert len({(x["job"], x["granted_at"]) for x in lines if "epoch" in x}) == 2 * per_job
    check_mutual_exclusion(holds)

    # Each job exited holding the trainer lock; the callback gave it back at exit.
    async with AsyncTimeSliceClient(cluster.targets, job_id="observer") as observer:
        status = await observer.status("trainer")
        assert not status.holder_job_id, (
            f"{status.holder_job_id} still holds the trainer group after its process exited"
        )
    assert time.time() - exited_at < SESSION_TTL
