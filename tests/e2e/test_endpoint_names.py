"""Addresses given as DNS names, several at once, work everywhere a component takes a list of
them: the agent's orchestrators, the SDK's targets and the CLI's (the etcd client's are in
tests/faults/test_etcd_ha.py), including failing over from one name to the next."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient, register
from timeslice_tools.dev._procs import free_ports, spawn
from timeslice_tools.dev.certs import Pki

NODE = "named-node"


def by_name(target: str) -> str:
    host, port = target.rsplit(":", 1)
    assert host == "127.0.0.1"
    return f"localhost:{port}"


def ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{http}/readyz", timeout=2) as reply:
            return int(reply.status) == 200
    except OSError:
        return False


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


async def wait_ready(http: str, agent: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while not await asyncio.to_thread(ready, http):
        assert agent.poll() is None, await asyncio.to_thread(tail, log)
        assert time.monotonic() < deadline, await asyncio.to_thread(tail, log)
        await asyncio.sleep(0.1)


async def test_agent_sdk_and_cli_reach_replicas_by_name_and_fail_over(
    cluster_factory: ClusterFactory, session_pki: Pki, tmp_path: Path
) -> None:
    cluster = cluster_factory(replicas=2, agents=0)
    names = [by_name(t) for t in cluster.targets]
    node = session_pki.node(NODE)
    (http_port,) = free_ports(1)
    http = f"127.0.0.1:{http_port}"
    socket = tmp_path / "agent.sock"
    log = tmp_path / "agent.log"
    agent = spawn(
        [
            sys.executable, "-m", "timeslice_agent",
            "--orchestrator", ",".join(names),
            "--node", NODE,
            "--backend", "sim",
            "--worker-socket", str(socket),
            "--http", http,
            "--sim-state-gb", "0.1",
            "--tls-ca", str(session_pki.ca),
            "--tls-cert", str(node.cert),
            "--tls-key", str(node.key),
        ],
        log,
    )  # fmt: skip
    workers = []
    try:
        await wait_ready(http, agent, log)
        workers = [register("g", job_id=job, socket=str(socket)) for job in ("a", "b")]
        async with (
            AsyncTimeSliceClient(names, job_id="a") as a,
            AsyncTimeSliceClient(list(reversed(names)), job_id="b") as b,
        ):
            await a.acquire("g", timeout=30)
            waiter = asyncio.create_task(b.acquire("g", timeout=30))
            await asyncio.sleep(0.2)
            await a.yield_("g")
            grant = await waiter
            # a was moved off the named node (b's state never left it: nothing restored).
            assert grant.previous_job_id == "a" and not grant.restored
            await b.yield_("g")

            # The first name goes away: the agent and the clients go on through the second.
            cluster.kill_replica(0)
            await wait_ready(http, agent, log)
            await a.acquire("g", timeout=30)
            status = await a.status("g")
            assert {n.node: n.resident_job_id for n in status.nodes} == {NODE: "a"}
            await a.yield_("g")

        # The CLI takes the same list of names.
        result = subprocess.run(
            [sys.executable, "-m", "timeslice.cli", "status", "g", "--target", ",".join(names)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert "g" in result.stdout and NODE in result.stdout, result.stdout
    finally:
        for w in workers:
            w.close()
        agent.terminate()
        try:
            agent.wait(timeout=15)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
