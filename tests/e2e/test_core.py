"""Co-operative time-slicing end to end: real etcd, orchestrator and agent processes, the SDK."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient, register
from timeslice.errors import Timeout
from timeslice_tools.dev.certs import Pki
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.history import Hold, check_fifo, check_mutual_exclusion

SIM_FAST = ["--sim-state-gb", "0.5", "--sim-bandwidth-gbps", "50"]


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus counter's samples matching ``labels`` (0 when absent)."""
    text = urllib.request.urlopen(f"http://{url}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def checkpoints(cluster: LocalCluster) -> float:
    return sum(
        metric(url, "timeslice_directives_total", kind="checkpoint", status="ok")
        for url in cluster.replica_http
    )


async def test_eight_jobs_contend_for_one_group(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(agents=1, agent_args=SIM_FAST)
    socket = str(cluster.agent_sockets["node-0"])
    jobs = [f"job-{i}" for i in range(8)]
    workers = [register("g", job_id=j, socket=socket, state_bytes=256 << 20) for j in jobs]
    phases_per_job = 25  # 8 x 25 = 200 phases
    holds: list[Hold] = []
    rng = random.Random(7)

    async def run(job: str) -> int:
        async with AsyncTimeSliceClient(cluster.target, job_id=job) as client:
            for _ in range(phases_per_job):
                grant = await client.acquire("g", timeout=60)
                start = time.monotonic()
                await asyncio.sleep(rng.uniform(0, 0.004))
                end = time.monotonic()
                holds.append(Hold(job, "g", grant.epoch, grant.ticket, start, end))
                await client.yield_("g")
                await asyncio.sleep(rng.uniform(0, 0.003))
        return phases_per_job

    try:
        done = await asyncio.wait_for(asyncio.gather(*(run(j) for j in jobs)), 150)
    finally:
        for w in workers:
            w.close()
    assert done == [phases_per_job] * 8, "every job finishes all its phases"
    assert len(holds) == 200
    check_mutual_exclusion(holds)
    check_fifo(holds)
    assert checkpoints(cluster) > 0, "jobs with device state were really switched"


async def test_lazy_switching_moves_nothing_when_nobody_waits(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=1, agent_args=SIM_FAST)
    socket = str(cluster.agent_sockets["node-0"])
    with (
        register("g", job_id="a", socket=socket, state_bytes=1 << 30),
        register("g", job_id="b", socket=socket, state_bytes=1 << 30),
    ):
        async with (
            AsyncTimeSliceClient(cluster.target, job_id="a") as a,
            AsyncTimeSliceClient(cluster.target, job_id="b") as b,
        ):
            first = await a.acquire("g", timeout=30)
            await a.yield_("g")
            for _ in range(5):
                again = await a.acquire("g", timeout=30)
                assert not again.restored
                await a.yield_("g")
            assert checkpoints(cluster) == 0, "yield with nobody waiting must not checkpoint"
            assert again.epoch > first.epoch

            await a.acquire("g", timeout=30)
            waiter = asyncio.create_task(b.acquire("g", timeout=30))
            await asyncio.sleep(0.3)
            assert not waiter.done()
            await a.yield_("g")
            grant_b = await waiter
            # b's first hold: a was checkpointed, but nothing of b was parked to bring back.
            assert not grant_b.restored and grant_b.previous_job_id == "a"
            assert checkpoints(cluster) == 1, "one switch checkpoints the resident job once"
            await b.yield_("g")


async def test_cancelled_waiter_leaves_the_queue(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(agents=0)
    async with (
        AsyncTimeSliceClient(cluster.target, job_id="holder") as holder,
        AsyncTimeSliceClient(cluster.target, job_id="quitter") as quitter,
        AsyncTimeSliceClient(cluster.target, job_id="next") as nxt,
    ):
        await holder.acquire("g")
        # A deadline passes while queued.
        with pytest.raises(Timeout):
            await quitter.acquire("g", timeout=0.5)
        # A task is cancelled while queued.
        task = asyncio.create_task(quitter.acquire("g"))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        waiting = asyncio.create_task(nxt.acquire("g", timeout=30))
        for _ in range(100):
            status = await holder.status("g")
            if [q.job_id for q in status.queue] == ["next"]:
                break
            await asyncio.sleep(0.05)
        assert [q.job_id for q in status.queue] == ["next"], "the cancelled waiters left the queue"
        await holder.yield_("g")
        grant = await waiting
        assert grant.job_id == "next"
        await nxt.yield_("g")


HOLDER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from timeslice import TimeSliceOrchestratorClient
    client = TimeSliceOrchestratorClient(sys.argv[1], job_id="doomed", session_ttl=2)
    grant = client.acquire("g", timeout=30)
    print("granted", grant.epoch, flush=True)
    time.sleep(600)
    """
)


async def test_dead_holder_frees_the_group_within_ttl(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(agents=0)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER_SCRIPT, cluster.target], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line.startswith("granted"), line
        async with AsyncTimeSliceClient(cluster.target, job_id="survivor") as client:
            waiter = asyncio.create_task(client.acquire("g", timeout=30))
            await asyncio.sleep(0.5)
            assert not waiter.done()
            os.kill(proc.pid, signal.SIGKILL)
            killed = time.monotonic()
            grant = await waiter
            elapsed = time.monotonic() - killed
            # Up to the TTL for the lease, 0.5 s for etcd to find it expired, then the grant.
            assert elapsed <= 2 + 2.5, f"granted {elapsed:.2f} s after the holder died (TTL 2 s)"
            assert grant.job_id == "survivor"
    finally:
        proc.kill()
        proc.wait()


SNIPPET = textwrap.dedent(
    """
    from timeslice import TimeSliceOrchestratorClient
    orchestrator = TimeSliceOrchestratorClient(target="localhost:50051")
    @orchestrator.on_accelerators(group_id="trainer-group")
    def train_phase(model, trajectories):
        return model.update(trajectories)
    """
)

DRIVER = textwrap.dedent(
    """
    import sys, time
    target = sys.argv[1]
    source = open(sys.argv[2]).read().replace("localhost:50051", target)
    namespace = {}
    exec(compile(source, "announcement_snippet.py", "exec"), namespace)

    class Model:
        steps = 0
        def update(self, trajectories):
            time.sleep(0.02)
            self.steps += 1
            return self.steps

    model = Model()
    for step in range(10):
        time.sleep(0.02)  # rollout and rewards happen off the shared group
        assert namespace["train_phase"](model, [step]) == step + 1
    print("done", model.steps, flush=True)
    """
)


def test_announcement_snippet_runs_unchanged(tmp_path: Path, session_pki: Pki) -> None:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    cli = Path(sys.executable).parent / "timeslice"
    # The session's certificates: the jobs find them in $TIMESLICE_TLS_*.
    argv = [str(cli), "dev", "cluster", "--agents", "1", "--base-dir", str(tmp_path / "cluster"),
            "--certs", str(session_pki.directory)]  # fmt: skip
    dev = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert dev.stdout is not None
        line = dev.stdout.readline()
        match = re.fullmatch(r"ready (\S+)\n", line)
        assert match, f"unexpected first line {line!r}"
        target = match.group(1)
        jobs = [
            subprocess.Popen(
                [sys.executable, str(driver), target, str(snippet)],
                env={**os.environ, "TIMESLICE_JOB_ID": f"rl-job-{i}"},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(2)
        ]
        for job in jobs:
            out, err = job.communicate(timeout=60)
            assert job.returncode == 0, err
            assert out.strip() == "done 10"
    finally:
        dev.send_signal(signal.SIGINT)
        assert dev.wait(timeout=30) == 0
