"""An agent that cannot write its state file is fenced out, not its jobs faulted (issue 37, 5).

Real processes: etcd, orchestrator replicas and sim agents. The state file of one agent lives
on a tiny tmpfs of its own (mounted by the test, which runs as root: root ignores permission
bits, so the disk is made full by a filler file, or read-only by a remount).

Before the fix, a full disk made the agent ack every checkpoint FAILED ("cannot persist state
before acting"), and the orchestrator isolated the jobs (GroupFaulted) again and again; and an
agent started with an unwritable state file exited with status 2.
"""

from __future__ import annotations

import asyncio
import errno
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ClusterFactory
from tests.faults.harness import http_get, wait_for_status
from timeslice import AsyncTimeSliceClient, register
from timeslice_proto.timeslice.v1 import GroupStatus
from timeslice_tools.history import Hold, Recorder, check_mutual_exclusion

pytestmark = pytest.mark.slow

# 2 GB at 20 GB/s: every checkpoint and restore takes about 0.1 s.
FAST_SIM = ["--sim-bandwidth-gbps", "20", "--sim-state-gb", "2"]
# Far longer than the bounds below: only the fence can explain a quick grant, not a missed
# deadline, nor the node's agent lease running out.
DIRECTIVE_TIMEOUT = 20.0
AGENT_TTL = 60
# A switch that goes on without the fenced node, on a loaded 2-core machine.
GRANT_BOUND = 6.0
# From the disk writable again to the node serving its group again (the agent retries its
# write at most every 2 s, then says hello again).
REJOIN_BOUND = 6.0
_FENCED_UNWRITABLE = re.compile(
    rb'^timeslice_agents_fenced_total\{reason="unwritable"\} (\S+)$', re.MULTILINE
)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs of its own (unmounted at the end)."""
    path = tmp_path / "disk"
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path) -> Path:
    """Fill ``disk`` up; the file that fills it (delete it to free the space)."""
    filler = disk / "filler"
    chunk = b"\0" * 4096
    with open(filler, "wb", buffering=0) as fh:
        while True:
            try:
                fh.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
                break
    return filler


def remount(disk: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(disk)], check=True)


async def _hold_once(
    client: AsyncTimeSliceClient, recorder: Recorder, timeout: float = 15.0
) -> float:
    """Acquire, hold briefly, yield; the seconds the acquire took."""
    started = recorder.now()
    grant = await client.acquire("g", timeout=timeout)
    granted = recorder.now()
    await asyncio.sleep(0.05)
    released = recorder.now()
    recorder.hold(Hold(client.job_id, "g", grant.epoch, grant.ticket, granted, released))
    await client.yield_("g")
    return granted - started


async def _fenced_for_the_disk(replicas: list[str]) -> float:
    """Nodes the replicas fenced out because their agent could not write its state file."""
    total = 0.0
    for address in replicas:
        answer = await http_get(address, "/metrics")
        assert answer is not None and answer[0] == 200, f"no metrics from {address}"
        found = _FENCED_UNWRITABLE.search(answer[1])
        assert found is not None, "timeslice_agents_fenced_total{reason=unwritable} missing"
        total += float(found.group(1))
    return total


def _residency(status: GroupStatus) -> dict[str, str]:
    return {n.node: n.resident_job_id for n in status.nodes}


async def test_a_full_state_disk_fences_the_node_instead_of_faulting_its_jobs(
    cluster_factory: ClusterFactory, small_disk: Path
) -> None:
    state_file = small_disk / "agent-node-1.json"
    cluster = cluster_factory(
        replicas=2,
        agents=2,
        agent_args=FAST_SIM,
        node_args={"node-1": ["--state-file", str(state_file)]},
        orchestrator_args=[
            "--agent-ttl",
            str(AGENT_TTL),
            "--directive-timeout",
            str(DIRECTIVE_TIMEOUT),
        ],
    )
    sockets = {n: str(cluster.agent_sockets[n]) for n in ("node-0", "node-1")}
    workers = [register("g", job_id=j, socket=s) for j in ("a", "b") for s in sockets.values()]
    recorder = Recorder()
    try:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="a") as a,
            AsyncTimeSliceClient(cluster.targets, job_id="b") as b,
            AsyncTimeSliceClient(cluster.targets, job_id="observer") as observer,
        ):
            # a's state goes onto both nodes.
            await _hold_once(a, recorder, 30)
            await wait_for_status(
                observer, "g", lambda s: _residency(s) == {"node-0": "a", "node-1": "a"}, 10
            )
            first = await a.acquire("g", timeout=30)
            first_at = recorder.now()
            waiter = asyncio.create_task(b.acquire("g", timeout=60))
            await wait_for_status(observer, "g", lambda s: [q.job_id for q in s.queue] == ["b"], 10)

            filler = await asyncio.to_thread(fill, small_disk)
            released = recorder.now()
            yielded = time.monotonic()
            await a.yield_("g")
            recorder.hold(Hold("a", "g", first.epoch, first.ticket, first_at, released))
            # The checkpoint of a on node-1 cannot be made durable: the node is fenced out and
            # the switch goes on without it. (Before: acked FAILED, a and b isolated.)
            grant = await asyncio.wait_for(waiter, DIRECTIVE_TIMEOUT + 10)
            granted_at = recorder.now()
            waited = time.monotonic() - yielded
            assert grant.job_id == "b"
            assert waited < GRANT_BOUND, f"b granted {waited:.1f} s after the yield"
            status = await observer.status("g")
            # Said by the replica that fenced it, or, when another replica's driver learned of
            # it through the vanished agent record first, as leaving (the agent TTL is 60 s
            # here, so only the fence can have removed it).
            assert (
                "cannot write its state file" in status.last_error
                or "node node-1 left its groups" in status.last_error
            ), status.last_error
            assert await _fenced_for_the_disk(cluster.replica_http) == 1
            assert _residency(status) == {"node-0": "b"}  # node-1 is out of the group
            await asyncio.sleep(0.05)
            recorder.hold(Hold("b", "g", grant.epoch, grant.ticket, granted_at, recorder.now()))
            await b.yield_("g")

            # The group keeps serving on node-0, and no job is faulted for node-1's disk.
            for client in (a, b, a):
                took = await _hold_once(client, recorder)
                assert took < GRANT_BOUND, f"{client.job_id} waited {took:.1f} s"
            assert cluster.services["node-1"].is_running()
            log = cluster.log_tail("node-1", 400)
            assert "cannot be written" in log, log

            # Space is freed: the agent's retry writes, it says hello again and rejoins.
            await asyncio.to_thread(filler.unlink)
            freed = time.monotonic()
            await wait_for_status(
                observer, "g", lambda s: "node-1" in _residency(s), REJOIN_BOUND, interval=0.05
            )
            # And serves: a switch restores a on both nodes again.
            took = await _hold_once(a, recorder)
            assert took < GRANT_BOUND, f"a waited {took:.1f} s after node-1 rejoined"
            await wait_for_status(
                observer, "g", lambda s: _residency(s) == {"node-0": "a", "node-1": "a"}, 10
            )
            back = time.monotonic() - freed
            assert back < REJOIN_BOUND + GRANT_BOUND, f"node-1 served {back:.1f} s after"
        check_mutual_exclusion(recorder.holds)
    finally:
        for worker in workers:
            worker.close()


async def test_an_agent_started_with_an_unwritable_state_file_waits_for_it(
    cluster_factory: ClusterFactory, small_disk: Path
) -> None:
    state_file = small_disk / "agent-node-0.json"
    cluster = cluster_factory(
        agents=1,
        agent_args=FAST_SIM,
        node_args={"node-0": ["--state-file", str(state_file)]},
    )
    cluster.stop_agent("node-0")
    await asyncio.to_thread(remount, small_disk, "ro")
    # Waits for /readyz (30 s at most); before the fix the agent exited with status 2 and
    # this raised at once.
    starting = asyncio.create_task(asyncio.to_thread(cluster.start_agent, "node-0"))
    try:
        await asyncio.sleep(4.0)
        assert not starting.done(), "the agent became ready with a read-only state file"
        assert cluster.services["node-0"].is_running()
        log = cluster.log_tail("node-0", 400)
        # Said once, clearly; retried quietly.
        assert log.count("not serving until it can be written") == 1, log
        assert "Read-only file system" in log, log
        serving = await asyncio.to_thread(cluster.agent_sockets["node-0"].exists)
        assert not serving  # the worker socket is not served yet
        await asyncio.to_thread(remount, small_disk, "rw")
        writable = time.monotonic()
        await asyncio.wait_for(starting, 15)
        ready = time.monotonic() - writable
        assert ready < REJOIN_BOUND, f"ready {ready:.1f} s after the disk became writable"
    finally:
        if not starting.done():
            await asyncio.to_thread(remount, small_disk, "rw")
            await asyncio.wait({starting}, timeout=30)
    worker = register("g", job_id="a", socket=str(cluster.agent_sockets["node-0"]))
    try:
        async with AsyncTimeSliceClient(cluster.targets, job_id="a") as a:
            grant = await a.acquire("g", timeout=15)
            assert grant.job_id == "a"
            await a.yield_("g")
    finally:
        worker.close()
