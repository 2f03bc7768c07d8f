"""``timeslice top`` against a live cluster (TLS, the operator certificate the CLI finds in
``$TIMESLICE_TLS_*``): ``--once`` names the group, its holder and its queue; the live view
follows a switch and ends cleanly on Ctrl-C."""

from __future__ import annotations

import asyncio
import signal
import sys

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient
from timeslice_proto.timeslice.v1 import GroupStatus, NodeResidency, QueueEntry
from timeslice_tools.cli.top import RecentSwitch, render_frame

TIMESLICE = [sys.executable, "-m", "timeslice_tools.cli"]


async def top(*args: str, timeout: float = 30) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *TIMESLICE, "top", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_a_frame_shows_groups_and_keeps_escapes_out() -> None:
    status = GroupStatus(
        group_id="g\x1b[2Jx",
        holder_job_id="a",
        held_since=90.0,
        queue=[QueueEntry(job_id="c", revision=9), QueueEntry(job_id="b", revision=8)],
        nodes=[NodeResidency(node="n1", resident_jobs=["a"])],
        switches=3,
    )
    frame = render_frame(
        [status], [RecentSwitch("g", "x", "a", 1.5, 95.0)], 100.0, width=200, source="t:1"
    )
    assert "\x1b" not in frame
    assert "g?[2Jx  holder a (10.0s)  queue[2]: b, c  switches 3" in frame
    assert "nodes: n1=a (no agent)" in frame
    assert "emulated" not in frame
    assert "g  x -> a  ~1.50s" in frame


async def test_top_once_and_live_against_a_cluster(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(replicas=2, agents=0)
    async with (
        AsyncTimeSliceClient(cluster.targets, job_id="top-a") as a,
        AsyncTimeSliceClient(cluster.targets, job_id="top-b") as b,
    ):
        await a.acquire("top-g", timeout=30)
        waiter = asyncio.create_task(b.acquire("top-g", timeout=30))
        async with asyncio.timeout(60):  # each --once starts Python: seconds on a loaded machine
            while "queue[1]" not in (frame := (await top("--once", "--target", cluster.target))[1]):
                await asyncio.sleep(0.2)
        code, frame, err = await top("--once", "--target", cluster.target)
        assert code == 0, err
        assert "timeslice top" in frame and "1 group(s)" in frame
        assert "top-g  holder top-a (" in frame
        assert "queue[1]: top-b" in frame

        # Live: frames follow the switch; Ctrl-C ends it with status 0.
        proc = await asyncio.create_subprocess_exec(
            *TIMESLICE,
            "top",
            "--target",
            ",".join(cluster.targets),
            "--interval",
            "0.2",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        seen = ""
        try:
            # Generous: a loaded 2-core machine starts a Python process in seconds.
            async with asyncio.timeout(60):
                while "top-g  holder top-a" not in seen:
                    seen += (await proc.stdout.readline()).decode()
                await a.yield_("top-g")
                await waiter
                while "top-a -> top-b" not in seen:
                    seen += (await proc.stdout.readline()).decode()
            assert "top-g  holder top-b (" in seen.rsplit("timeslice top", 1)[-1]
        except TimeoutError:
            raise AssertionError(f"top did not show the hand-over; it printed:\n{seen}") from None
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                _, err_bytes = await asyncio.wait_for(proc.communicate(), 30)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise AssertionError(f"top did not end on SIGINT; it printed:\n{seen}") from None
        assert proc.returncode == 0, err_bytes.decode()
        await b.yield_("top-g")
