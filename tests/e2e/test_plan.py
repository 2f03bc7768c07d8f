"""The placement advisor: its prediction, from recorded usage, against a real shared run."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient
from timeslice.plan import Proposal, Workload, propose
from timeslice_tools.dev.timeline import Interval, duty_cycle
from timeslice_tools.history import Attempt, Hold, Recorder

# A job alone keeps its accelerators 30% busy. Phases of a second, not a fifth: on a loaded
# 2-core machine every Acquire and Yield takes tens of milliseconds, which the server counts
# into the hold; with 80 ms holds that once made each job look 63% busy, and the plan kept
# the two apart. 8 steps, not 12: the plan needs only each job's busy share, which 8 seconds
# of one-second steps measure as well; the test still proves the prediction brackets the
# measured shared duty cycle, and 8 s less of each run keeps it at about 17 s.
ON, OFF, STEPS = 0.3, 0.7, 8


def test_first_fit_decreasing_respects_the_cap() -> None:
    loads = [Workload(f"j{i}", "g", busy, 1.0) for i, busy in enumerate([0.5, 0.4, 0.4, 0.3])]
    proposals = propose(loads, cap=0.9)
    assert [[w.job for w in p.workloads] for p in proposals] == [["j0", "j1"], ["j2", "j3"]]
    assert [round(p.predicted_duty, 2) for p in proposals] == [0.9, 0.7]
    # Switches count against sharing: 0.05 s x 2 grants/s x 2 jobs = 20% of the time.
    costly = propose(loads[1:3], cap=0.85, switch_seconds=0.05)
    assert len(costly) == 2
    assert Proposal(loads[1:3], 0.05).predicted_duty == 0.8


async def _run(client: AsyncTimeSliceClient, group: str, recorder: Recorder) -> None:
    for _ in range(STEPS):
        await asyncio.sleep(OFF)  # rewards, environment: off the accelerator
        asked = recorder.now()
        grant = await client.acquire(group, timeout=30)
        start = recorder.now()
        recorder.attempt(Attempt(client.job_id, group, asked, start))
        await asyncio.sleep(ON)
        end = recorder.now()
        recorder.hold(Hold(client.job_id, group, grant.epoch, grant.ticket, start, end))
        await client.yield_(group)


def _window(recorder: Recorder, group: str) -> Interval:
    holds = [h for h in recorder.holds if h.group == group]
    return Interval(min(h.granted_at for h in holds), max(h.released_at for h in holds))


def _duty(recorder: Recorder, group: str) -> float:
    holds = [h for h in recorder.holds if h.group == group]
    return duty_cycle(
        [Interval(h.granted_at, h.released_at) for h in holds], _window(recorder, group)
    )


def _hand_over_share(recorder: Recorder, group: str) -> float:
    """The share of the window the accelerators sat idle between a release and the grant of
    a job that was already waiting for it: the switch cost the model leaves out, as measured."""
    holds = sorted((h for h in recorder.holds if h.group == group), key=lambda h: h.granted_at)
    asked = {(a.job, a.granted_at): a.started_at for a in recorder.attempts if a.group == group}
    idle = 0.0
    for before, after in itertools.pairwise(holds):
        if asked[(after.job, after.granted_at)] < before.released_at < after.granted_at:
            idle += after.granted_at - before.released_at
    window = _window(recorder, group)
    return idle / (window.end - window.start)


async def test_plan_predicts_the_shared_duty_cycle(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(agents=0)
    recorder = Recorder()
    async with (
        AsyncTimeSliceClient(cluster.target, job_id="a") as a,
        AsyncTimeSliceClient(cluster.target, job_id="b") as b,
    ):
        await asyncio.gather(_run(a, "dedicated-a", recorder), _run(b, "dedicated-b", recorder))
        out = await asyncio.to_thread(
            subprocess.run,
            # A cap of 1: each job is ~30% busy alone, and a loaded machine stretches holds.
            [
                sys.executable, "-m", "timeslice.cli", "plan", "--json",
                "--cap", "1.0", "--target", cluster.target,
            ],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        proposals = json.loads(out.stdout)
        assert len(proposals) == 1, proposals
        assert sorted(w["job"] for w in proposals[0]["workloads"]) == ["a", "b"]
        predicted = proposals[0]["predicted_duty"]
        assert 2 * ON / (ON + OFF) - 0.05 <= predicted <= 1.0

        await asyncio.gather(_run(a, "shared", recorder), _run(b, "shared", recorder))
    measured = _duty(recorder, "shared")
    # The model leaves out switch costs, so sharing reaches at most about the prediction.
    # Below it by the hand-overs, which stretch on a loaded 2-core machine (0.58 measured
    # against 0.89 predicted once, in CI beside other load): add their measured idle time
    # back, and the rest stays close, while a wrong model is off by far more.
    hand_overs = _hand_over_share(recorder, "shared")
    assert predicted - 0.3 <= measured + hand_overs, (measured, hand_overs, predicted)
    assert measured <= predicted + 0.1, (measured, predicted)
    assert _duty(recorder, "dedicated-a") < measured
