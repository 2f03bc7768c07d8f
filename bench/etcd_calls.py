"""How many etcd calls an acquire/yield cycle costs, counted by etcd itself.

    python -m bench.etcd_calls                 # 200 cycles of each kind
    python -m bench.etcd_calls --cycles 1000

A cluster of one replica and no agents; two jobs on one group. Two kinds of cycle:

- **free**: one job acquires a free group nobody waits for, then yields it (the grant in
  place inside the Acquire's own transaction);
- **hand-over**: the other job is queued when the holder yields, and the yield's replica
  grants it at once (its state needs no moving); per cycle the waiter's enqueue, and the
  release and the grant, in one transaction (a new deployment: the features record allows
  it, store/handover.py), then again in two (the record switched off, as on a deployment
  upgraded from an older version that has not enabled it).

The counts are the differences of etcd's own ``grpc_server_handled_total`` (calls answered OK,
by method) and ``etcd_mvcc_*_total`` (its store operations) over the cycles, divided by their
number: a count, not a timing, so it is the same on a loaded machine as on a quiet one (unless
the cycles stall for 5 s: a replica whose watch brought nothing for that long writes its
beacon, one Put, see ``WATCH_QUIET_AFTER``). The hand-over's two transactions (enqueue,
then release-and-grant) are the least the design allows: the waiter must be in line before
the holder yields.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import urllib.request

from bench._common import running_cluster
from timeslice import AsyncTimeSliceClient
from timeslice_orchestrator.store.etcd import EtcdClient
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.records import FeaturesRecord

_HANDLED = re.compile(
    r'^grpc_server_handled_total\{grpc_code="OK",grpc_method="(\w+)",'
    r'grpc_service="[\w.]*?(\w+)",grpc_type="\w+"\} (\S+)$'
)
_STORE = re.compile(r"^(etcd_mvcc_(?:put|range|txn|delete)_total) (\S+)$")
_GROUP = "calls"


def _counts(endpoint: str) -> dict[str, float]:
    """etcd's call and store-operation counters, from its /metrics."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as answer:
        text = answer.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if handled := _HANDLED.match(line):
            counts[f"{handled.group(2)}.{handled.group(1)}"] = float(handled.group(3))
        elif store := _STORE.match(line):
            counts[store.group(1)] = float(store.group(2))
    return counts


def _per_cycle(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    return {
        name: round((after[name] - before.get(name, 0.0)) / n, 3)
        for name in sorted(after)
        if after[name] - before.get(name, 0.0) > 0
    }


async def measure(cycles: int) -> dict[str, dict[str, float]]:
    """Per-cycle counts of both kinds of cycle."""
    async with running_cluster(replicas=1, agents=0) as cluster:
        assert cluster.etcd is not None, "the cluster runs its own etcd"
        endpoint = cluster.etcd.endpoint
        targets, tls = cluster.targets, cluster.client_tls
        async with (
            AsyncTimeSliceClient(targets, job_id="a", **tls) as a,
            AsyncTimeSliceClient(targets, job_id="b", **tls) as b,
        ):
            for _ in range(20):  # sessions, connections, the group's records
                await a.acquire(_GROUP, timeout=30)
                await a.yield_(_GROUP)
            await asyncio.sleep(1.0)
            start = _counts(endpoint)
            for _ in range(cycles):
                await a.acquire(_GROUP, timeout=30)
                await a.yield_(_GROUP)
            free = _per_cycle(start, _counts(endpoint), cycles)

            holder, waiter = a, b
            await holder.acquire(_GROUP, timeout=30)
            handovers: dict[str, dict[str, float]] = {}
            for way in ("one transaction", "two transactions"):
                if way == "two transactions":
                    await _switch_off_features(endpoint, cluster.prefix)
                start = _counts(endpoint)
                for _ in range(cycles):
                    waiting = asyncio.create_task(waiter.acquire(_GROUP, timeout=30))
                    await asyncio.sleep(0.01)  # queued before the yield
                    await holder.yield_(_GROUP)
                    await waiting
                    holder, waiter = waiter, holder
                handovers[f"hand-over, {way}"] = _per_cycle(start, _counts(endpoint), cycles)
            await holder.yield_(_GROUP)
    return {"free": free, **handovers}


async def _switch_off_features(endpoint: str, prefix: str) -> None:
    """What ``timeslice orchestrator features disable`` does; then a moment for the mirror."""
    etcd = EtcdClient([endpoint])
    try:
        await etcd.put(Keyspace(prefix).features(), FeaturesRecord().encode())
    finally:
        await etcd.close()
    await asyncio.sleep(1.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=200, help="cycles of each kind")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error("--cycles must be at least 1")
    results = asyncio.run(measure(args.cycles))
    for kind, counts in results.items():
        print(f"{kind} cycle, per cycle ({args.cycles} cycles):")
        for name, value in counts.items():
            print(f"  {name:40s} {value:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
