"""Handoff latency with the holder and the waiter in two processes, as two jobs run.

    python -m bench.handoff_two                  # 200 hand-overs, 1 replica
    python -m bench.handoff_two --samples 500

:func:`bench.controlplane.handoff_latency` (the figure of the targets) runs both jobs' clients
in one process, so one loop reads the waiter's grant and the holder's Yield answer in turn.
Here each job has a process of its own, as jobs do. Each runs the same loop: acquire, wait
until the other job is queued, idle 5 ms (as the single-process benchmark does), yield. A
hand-over is from one process's yield call to the other's acquire returning; both stamp
``time.perf_counter`` (CLOCK_MONOTONIC, one clock for every process on Linux). A figure beside
the single-process one, not instead of it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import cast

from bench._common import running_cluster
from bench.analysis import Stats
from timeslice import AsyncTimeSliceClient
from timeslice_tools.dev.cluster import ClientTls

_GROUP = "handoff-two"
_SETTLE_SECONDS = 0.005  # bench.controlplane's pause before each yield
_QUEUED_TIMEOUT = 5.0  # the last yield of a run finds nobody queued: it goes anyway
_CALL_TIMEOUT = 30.0


@dataclass(frozen=True)
class TwoProcessHandoff:
    samples: int
    handoff_ms: Stats


async def _peer(target: str, job: str, rounds: int, tls: ClientTls) -> None:
    """One job's loop; prints one JSON line per grant and per yield."""

    def emit(kind: str, at: float) -> None:
        print(json.dumps({"job": job, "kind": kind, "t": at}), flush=True)

    async with AsyncTimeSliceClient(
        [target], job_id=job, call_timeout=_CALL_TIMEOUT, **tls
    ) as client:
        for _ in range(rounds):
            await client.acquire(_GROUP, timeout=_CALL_TIMEOUT)
            emit("grant", time.perf_counter())
            deadline = time.monotonic() + _QUEUED_TIMEOUT
            while not (await client.status(_GROUP)).queue and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            await asyncio.sleep(_SETTLE_SECONDS)
            t0 = time.perf_counter()
            await client.yield_(_GROUP)
            emit("yield", t0)


async def measure(samples: int) -> TwoProcessHandoff:
    """``samples`` hand-overs (and a few to warm up) between two job processes."""
    rounds = samples // 2 + 6
    async with running_cluster(replicas=1, agents=0) as cluster:
        tls = json.dumps(dict(cluster.client_tls))
        peers = []
        for job in ("a", "b"):
            argv = [sys.executable, "-m", "bench.handoff_two", "--peer", cluster.targets[0]]
            peers.append(
                subprocess.Popen([*argv, job, str(rounds), tls], stdout=subprocess.PIPE, text=True)
            )
            await asyncio.sleep(1.0)  # a holds first; b queues behind it
        outputs = await asyncio.gather(*(asyncio.to_thread(p.communicate) for p in peers))
        for peer in peers:
            if peer.returncode:
                raise RuntimeError(f"a peer exited with {peer.returncode}")
    events = sorted(
        (json.loads(line) for out, _ in outputs for line in out.splitlines()),
        key=lambda e: e["t"],
    )
    handoffs = []
    last_yield: dict[str, float] = {}
    for event in events:
        if event["kind"] == "yield":
            last_yield[event["job"]] = event["t"]
            continue
        other = "b" if event["job"] == "a" else "a"
        if other in last_yield:
            handoffs.append(event["t"] - last_yield.pop(other))
    kept = handoffs[10:]  # warm-up: sessions, connections, the group's records
    return TwoProcessHandoff(len(kept), Stats.of(kept).scaled(1000))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--peer", nargs=4, metavar=("TARGET", "JOB", "ROUNDS", "TLS"))
    args = parser.parse_args(argv)
    if args.peer:
        target, job, rounds, tls = args.peer
        asyncio.run(_peer(target, job, int(rounds), cast(ClientTls, json.loads(tls))))
        return 0
    result = asyncio.run(measure(args.samples))
    print(json.dumps(asdict(result)))
    h = result.handoff_ms
    print(f"two-process handoff: {result.samples} samples, p50 {h.p50:.2f} ms, p99 {h.p99:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
