"""A paused agent (SIGSTOP) is fenced out of its group instead of stalling it (issue 13, 3).

Real processes: etcd, two replicas, two sim agents with 1 s checkpoints and restores. One
agent is paused for far longer than the liveness timeout, either in the middle of a switch's
checkpoint or just before a switch begins. The group must go on granting on the node that
answers within the liveness timeout plus the switch itself, say why in its status, and never
let two holds overlap. After SIGCONT the woken agent must not execute the directive that
waited in its socket buffer during the pause (nor any other directive older than its fence),
its residency must be reconciled from its hello, and the group must serve across both nodes
again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ClusterFactory
from tests.faults.harness import journals, report_recovery, wait_for_status
from timeslice import AsyncTimeSliceClient, register
from timeslice_agent.journal import JournalEntry
from timeslice_proto.timeslice.v1 import SwitchPhase
from timeslice_tools.history import (
    Hold,
    Recorder,
    check_fencing,
    check_mutual_exclusion,
    check_two_phase,
)

# 1 GB at 2 GB/s: every checkpoint and restore takes about 0.5 s, long enough to pause an
# agent in the middle of one (its state file says so within milliseconds).
SLOW_SIM = ["--sim-bandwidth-gbps", "2", "--sim-state-gb", "1"]
SWITCH_SECONDS = 1.0  # a checkpoint then a restore
LIVENESS = 1.5  # --agent-liveness-timeout
# Short, but above STALL_BOUND: a grant within the bound can only come from the fence, never
# from the directive's deadline.
DIRECTIVE_TIMEOUT = 8.0
# Longer than both, so that without fencing nothing would be granted meanwhile and the
# directive's deadline passes during the pause. It was 25 s with 1 s moves; the work done
# during the pause (the fence, then three holds on the other node) takes about 6 s here, so
# 15 s still leaves room on a loaded machine (the test fails, not passes, when it is too slow).
PAUSE = 15.0
# Grants must resume within the liveness timeout plus a switch, plus slack for a busy machine.
STALL_BOUND = LIVENESS + SWITCH_SECONDS + 4.0
assert STALL_BOUND < DIRECTIVE_TIMEOUT < PAUSE

pytestmark = pytest.mark.slow


async def _hold_once(client: AsyncTimeSliceClient, recorder: Recorder, timeout: float) -> float:
    """Acquire, hold briefly, yield; the seconds the acquire took."""
    started = recorder.now()
    grant = await client.acquire("g", timeout=timeout)
    granted = recorder.now()
    await asyncio.sleep(0.05)
    released = recorder.now()
    recorder.hold(Hold(client.job_id, "g", grant.epoch, grant.ticket, granted, released))
    await client.yield_("g")
    return granted - started


async def _fenced_state(path: Path, timeout: float) -> dict[str, Any]:
    """The agent's state file once it records a fence (its Welcome is handled after the
    hello, and the file is written after that)."""
    deadline = time.monotonic() + timeout
    while True:
        state: dict[str, Any] = json.loads(await asyncio.to_thread(path.read_text))
        if state.get("fence_revision", 0) > 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"no fence recorded in {path} within {timeout} s: {state}")
        await asyncio.sleep(0.05)


async def _transitioning(path: Path, job: str, timeout: float) -> None:
    """Return once the agent's state file shows ``job`` mid-move (written before it acts)."""
    deadline = time.monotonic() + timeout
    while True:
        state: dict[str, Any] = json.loads(await asyncio.to_thread(path.read_text))
        if state.get("jobs", {}).get(job, {}).get("state") == "transitioning":
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{job} never began a move in {path} within {timeout} s: {state}")
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("when", ["during-checkpoint", "before-switch"])
async def test_paused_agent_is_fenced_out(cluster_factory: ClusterFactory, when: str) -> None:
    cluster = cluster_factory(
        replicas=2,
        agents=2,
        agent_args=SLOW_SIM,
        orchestrator_args=[
            # Long enough that the node would stay a member all through the pause unless
            # it is fenced out.
            "--agent-ttl",
            "60",
            "--agent-liveness-timeout",
            str(LIVENESS),
            "--directive-timeout",
            str(DIRECTIVE_TIMEOUT),
        ],
    )
    sockets = {n: str(cluster.agent_sockets[n]) for n in ("node-0", "node-1")}
    workers = [register("g", job_id=j, socket=s) for j in ("a", "b") for s in sockets.values()]
    paused_pid = cluster.services["node-1"].pid
    assert paused_pid is not None
    recorder = Recorder()
    resumed = False
    late: list[JournalEntry] = []
    try:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="a") as a,
            AsyncTimeSliceClient(cluster.targets, job_id="b") as b,
            AsyncTimeSliceClient(cluster.targets, job_id="observer") as observer,
        ):
            # a's state goes onto both nodes.
            await _hold_once(a, recorder, 30)
            await wait_for_status(
                observer,
                "g",
                lambda s: (
                    {n.node: n.resident_job_id for n in s.nodes} == {"node-0": "a", "node-1": "a"}
                ),
                10,
            )
            first = await a.acquire("g", timeout=30)
            first_at = recorder.now()
            waiter = asyncio.create_task(b.acquire("g", timeout=60))
            await wait_for_status(observer, "g", lambda s: [q.job_id for q in s.queue] == ["b"], 10)
            if when == "before-switch":
                # Paused first: the switch's checkpoint waits in node-1's socket buffer.
                os.kill(paused_pid, signal.SIGSTOP)
                paused, paused_wall = time.monotonic(), time.time()
                released = recorder.now()
                await a.yield_("g")
            else:
                released = recorder.now()
                await a.yield_("g")
                await wait_for_status(
                    observer,
                    "g",
                    lambda s: s.switch is not None and s.switch.phase == SwitchPhase.CHECKPOINT,
                    10,
                    interval=0.005,
                )
                # The switch record says CHECKPOINT once the directives are posted; node-1 may
                # not have begun yet (then it refuses the directive when it wakes, as before a
                # switch). Its state file says TRANSITIONING once it has: pause it then.
                await _transitioning(cluster.agent_state_files["node-1"], "a", 10)
                os.kill(paused_pid, signal.SIGSTOP)  # mid-checkpoint on node-1
                paused, paused_wall = time.monotonic(), time.time()
            recorder.hold(Hold("a", "g", first.epoch, first.ticket, first_at, released))

            grant = await asyncio.wait_for(waiter, STALL_BOUND + 5)
            granted_at = recorder.now()
            stall = time.monotonic() - paused
            report_recovery(f"pause agent {when}: next grant", stall)
            assert grant.job_id == "b"
            assert stall < STALL_BOUND, f"no grant for {stall:.1f} s after the pause"
            status = await observer.status("g")
            # Said by the replica that fenced it, or, when another replica's driver learned of
            # it through the vanished agent record first, as leaving (the agent TTL here is
            # 60 s, so only the fence can have removed it).
            assert (
                "node-1 fenced out" in status.last_error
                or "node node-1 left its groups" in status.last_error
            ), status.last_error
            # node-1 left the group: its residency is unknown, not "still a".
            assert {n.node: n.resident_job_id for n in status.nodes} == {"node-0": "b"}
            await asyncio.sleep(0.05)
            recorder.hold(Hold("b", "g", grant.epoch, grant.ticket, granted_at, recorder.now()))
            await b.yield_("g")

            # The group keeps serving on node-0 while node-1 stays paused.
            for client in (a, b, a):
                waited = await _hold_once(client, recorder, 15)
                assert waited < SWITCH_SECONDS + 4.0, f"{client.job_id} waited {waited:.1f} s"
            assert time.monotonic() - paused < PAUSE, "the test is too slow to prove anything"

            await asyncio.sleep(max(0.0, PAUSE - (time.monotonic() - paused)))
            os.kill(paused_pid, signal.SIGCONT)
            resumed = True
            woke_wall = time.time()

            # It says hello again: its residency comes from its own report, and it rejoins.
            rejoined = await wait_for_status(
                observer, "g", lambda s: any(n.node == "node-1" for n in s.nodes), 20
            )
            state = await _fenced_state(cluster.agent_state_files["node-1"], 10)
            fence = state["fence_revision"]
            # Fenced after a's hold began and before b's grant (which went on without it).
            assert first.epoch < fence < grant.epoch, (first.epoch, fence, grant.epoch)
            on_node1 = {n.node: n.resident_jobs for n in rejoined.nodes}["node-1"]
            jobs = state["jobs"]
            truth = [
                j for j, rec in jobs.items() if rec.get("state") in ("idle", "running")
            ]  # what the agent says is on its devices
            assert sorted(on_node1) == sorted(truth), (on_node1, jobs)
            # (b's freshly started workers count as on the devices until a checkpoint.)
            if when == "before-switch":
                # Its checkpoint never ran: a is still on node-1's devices, and says so.
                assert "a" in on_node1, on_node1
            else:
                # The checkpoint it had begun ran on after the pause: a is parked on the host,
                # or faulted by the directive's deadline (which passed during the pause).
                assert "a" not in on_node1, on_node1
                assert jobs["a"]["state"] in ("saved", "faulted"), jobs

            # Both nodes serve again: each grant now moves state on node-1 as well.
            for client in (b, a, b):
                await _hold_once(client, recorder, 30)
            final = await observer.status("g")
            assert {n.node: n.resident_job_id for n in final.nodes} == {
                "node-0": "b",
                "node-1": "b",
            }
            assert final.switch is None

            # Nothing older than its fence ran on node-1 after it woke.
            entries = journals(cluster)
            assert entries and any(e.node == "node-1" for e in entries)
            stale = [
                e
                for e in entries
                if e.node == "node-1"
                and e.status in ("ok", "failed")
                and e.epoch < fence
                and e.started_at >= paused_wall
            ]
            assert not stale, stale
            woke_late = [e for e in entries if e.node == "node-1" and e.started_at >= woke_wall]
            assert all(e.epoch > fence for e in woke_late if e.status == "ok"), woke_late
            # What node-1 had begun before the pause finished after it, outside the switch
            # that went on without it: only that, and only during a checkpoint.
            late = [
                e
                for e in entries
                if e.node == "node-1" and e.epoch < fence and e.finished_at >= paused_wall
            ]
            if when == "before-switch":
                assert not late, late
            else:
                assert [e.kind for e in late] == ["checkpoint"], late
                assert late[0].started_at < paused_wall, late
            if when == "before-switch":
                log = await asyncio.to_thread((cluster.log_dir / "node-1.log").read_text)
                assert "refused: event loop stalled" in log, log[-3000:]
    finally:
        if not resumed:
            os.kill(paused_pid, signal.SIGCONT)
        for w in workers:
            w.close()
    check_mutual_exclusion(recorder.holds)
    check_fencing(journals(cluster))
    # Two-phase order holds among the nodes that stayed in each switch; a fenced node's late
    # finish (checked above) is outside the switch that went on without it.
    check_two_phase([e for e in journals(cluster) if e not in late])


async def test_a_short_pause_mid_restore_does_not_hold_up_the_switch(
    cluster_factory: ClusterFactory,
) -> None:
    """An agent paused mid-restore for less than the liveness timeout but long enough to drop
    its stream (its own stall check) finishes the restore and says hello to the other
    replica. The replica whose stream it dropped must let go of it at once: its pending
    directive fails over (the agent answers the re-send from its ledger), and no directive
    goes into the dead stream. Found by the soak: a replica kept the dropped stream as the
    node's connection, and the switch waited out two full directive deadlines (31 s each)."""
    liveness = 6.0  # the agent drops its stream after a 3.75 s stall; fenced after 6 s
    pause = 4.5
    cluster = cluster_factory(
        tls=False,
        replicas=2,
        agents=2,
        agent_args=SLOW_SIM,
        orchestrator_args=[
            "--agent-ttl",
            "60",
            "--agent-liveness-timeout",
            str(liveness),
            "--directive-timeout",
            "20",
        ],
    )
    sockets = [str(cluster.agent_sockets[n]) for n in ("node-0", "node-1")]
    workers = [register("g", job_id=j, socket=s) for j in ("a", "b") for s in sockets]
    paused_pid = cluster.services["node-1"].pid
    assert paused_pid is not None
    resumed = False
    try:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="a", insecure=True) as a,
            AsyncTimeSliceClient(cluster.targets, job_id="b", insecure=True) as b,
        ):
            for client in (a, b):
                await client.acquire("g", timeout=30)
                await client.yield_("g")
            waiter = asyncio.create_task(a.acquire("g", timeout=60))
            # b is checkpointed, then a restored: pause node-1 once its restore has begun.
            await _transitioning(cluster.agent_state_files["node-1"], "a", 15)
            os.kill(paused_pid, signal.SIGSTOP)
            await asyncio.sleep(pause)
            os.kill(paused_pid, signal.SIGCONT)
            resumed = True
            woke = time.monotonic()
            grant = await asyncio.wait_for(waiter, 30)
            waited = time.monotonic() - woke
            report_recovery("agent paused mid-restore, stream dropped: grant after SIGCONT", waited)
            assert waited < 8.0, f"the switch went on {waited:.1f} s after the agent woke"
            assert grant.job_id == "a"
            await a.yield_("g")
            # Both nodes still serve the group: nothing was fenced for the pause.
            again = await b.acquire("g", timeout=30)
            status = await b.status("g")
            assert {n.node: n.resident_job_id for n in status.nodes} == {
                "node-0": "b",
                "node-1": "b",
            }, status
            assert again.epoch > grant.epoch
            await b.yield_("g")
    finally:
        if not resumed:
            os.kill(paused_pid, signal.SIGCONT)
        for w in workers:
            w.close()
    check_fencing(journals(cluster))
    check_two_phase(journals(cluster))
