"""The grant gap at an etcd leader loss, with the store client's member probe on and off.

    python -m bench.etcd_leader_loss                 # 3 rounds of each fault, probe on and off
    python -m bench.etcd_leader_loss --rounds 5 --modes on

One replica on a 3-member etcd on loopback (etcd's default timing: 100 ms heartbeat, 1 s
election timeout), two jobs handing one group back and forth (acquire, hold 20 ms, yield).
Each round finds the leader (etcd's Maintenance Status), kills it (SIGKILL) or pauses it
(SIGSTOP), and measures etcd's election time (from the fault until a live member names a new
leader, polled every 20 ms) and the longest gap between two consecutive grants around it;
then the member is brought back and the next round waits for 10 grants. "off" starts the
replica with ``--etcd-probe-after 0``: calls to a lost member wait for their 5 s deadline, as
before the probe. Prints one JSON line per round and a summary per mode and fault.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass

from bench._common import machine_info, machine_line, running_cluster
from timeslice import AsyncTimeSliceClient
from timeslice.errors import TimeSliceError
from timeslice_tools.dev.etcd import EtcdCluster

_GROUP = "leader-loss"
_CALL_TIMEOUT = 10.0
_ACQUIRE_TIMEOUT = 20.0
FAULTS = ("kill", "pause")


@dataclass(frozen=True)
class Round:
    mode: str  # "on" or "off": the member probe
    fault: str  # "kill" or "pause"
    election_s: float
    gap_s: float


async def _job(client: AsyncTimeSliceClient, grants: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await client.acquire(_GROUP, timeout=_ACQUIRE_TIMEOUT)
        except TimeSliceError:
            await asyncio.sleep(0.05)
            continue
        grants.append(time.monotonic())
        await asyncio.sleep(0.02)
        with contextlib.suppress(TimeSliceError):
            await client.yield_(_GROUP)
        await asyncio.sleep(0.005)


async def _grants_after(grants: list[float], moment: float, count: int) -> None:
    deadline = time.monotonic() + 60
    while sum(t > moment for t in grants) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} grants within 60 s")
        await asyncio.sleep(0.02)


async def _round(etcd: EtcdCluster, grants: list[float], mode: str, fault: str) -> Round:
    leader = await asyncio.to_thread(etcd.wait_for_leader)
    answer = await asyncio.to_thread(etcd.members[leader].status, 1.0)
    if answer is None:
        raise RuntimeError("the leader did not answer its status")
    await _grants_after(grants, time.monotonic(), 10)
    at = time.monotonic()
    if fault == "kill":
        await asyncio.to_thread(etcd.kill, leader)
    else:
        etcd.pause(leader)
    try:
        election = await asyncio.to_thread(etcd.elected_since, leader, answer[0], at, 30)
        await _grants_after(grants, at + election, 10)
    finally:
        if fault == "kill":
            await asyncio.to_thread(etcd.start_member, leader)
        else:
            etcd.resume(leader)
    times = sorted(grants)
    gap = max(b - a for a, b in itertools.pairwise(times) if b >= at and a <= at + election)
    await asyncio.to_thread(etcd.wait_for_leader)
    return Round(mode, fault, round(election, 3), round(gap, 3))


async def measure(rounds: int, modes: list[str]) -> list[Round]:
    """``rounds`` of each fault per mode, one cluster per mode."""
    results: list[Round] = []
    for mode in modes:
        args = [] if mode == "on" else ["--etcd-probe-after", "0"]
        async with running_cluster(
            replicas=1, agents=0, etcd_members=3, orchestrator_args=args
        ) as cluster:
            etcd = cluster.etcd_cluster
            assert etcd is not None
            grants: list[float] = []
            stop = asyncio.Event()
            clients = [
                AsyncTimeSliceClient(
                    cluster.targets, job_id=j, call_timeout=_CALL_TIMEOUT, **cluster.client_tls
                )
                for j in ("a", "b")
            ]
            runs = [asyncio.create_task(_job(c, grants, stop)) for c in clients]
            try:
                for _, fault in itertools.product(range(rounds), FAULTS):
                    result = await _round(etcd, grants, mode, fault)
                    print(json.dumps(asdict(result)), flush=True)
                    results.append(result)
            finally:
                stop.set()
                for run in runs:
                    run.cancel()
                await asyncio.gather(*runs, return_exceptions=True)
                for c in clients:
                    await c.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each fault per mode")
    parser.add_argument("--modes", nargs="+", choices=["on", "off"], default=["on", "off"])
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    print(machine_line(machine_info()), flush=True)
    results = asyncio.run(measure(args.rounds, args.modes))
    for mode, fault in itertools.product(args.modes, FAULTS):
        mine = [r for r in results if r.mode == mode and r.fault == fault]
        gaps = [r.gap_s for r in mine]
        excess = [r.gap_s - r.election_s for r in mine]
        print(
            f"probe {mode}, leader {fault}: grant gap median {statistics.median(gaps):.2f} s, "
            f"max {max(gaps):.2f} s; election median "
            f"{statistics.median(r.election_s for r in mine):.2f} s; gap minus election "
            f"median {statistics.median(excess):.2f} s, max {max(excess):.2f} s ({len(mine)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
