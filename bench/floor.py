"""The control plane next to its etcd floor, and two builds of it side by side in one run.

    python -m bench.floor                      # this tree only
    python -m bench.floor --before c84c137     # also the orchestrator as of that commit
    python -m bench.floor --before A --before B  # several
    python -m bench.floor --rounds 3 --json /tmp/floor.json

The floor is what etcd costs on this machine, from this process, through the same typed client
the orchestrator uses: a bare put, a bare transaction (one compare, one put) and a bare lease
grant, one at a time (round-trip p50/p99), transactions with 100 in flight (throughput), and a
transaction after 2 ms of idling (round trip), as a hand-over's is: on a virtual machine the
wake-ups of both processes cost more than the work, which back to back hides. It also prints
this process's CPU per back-to-back transaction, by thread (the loop's, gRPC's), and a gRPC
round trip after the same idling (:mod:`bench.grpc_floor`). A hand-over crosses gRPC in and out
and etcd once, so one of each after idling is its floor: the least it could take here with no
work at all. The host's speed drifts within a run, so that floor is measured again before
each round, and each handoff is printed as a multiple of its round's floor.

Each round runs, for every build, :func:`bench.controlplane.cycle_throughput` (100 groups,
1 replica: acquire/yield cycles per second and the replica's CPU per cycle) and
:func:`bench.controlplane.handoff_latency` (1 replica: yield -> the waiter's grant). Builds
alternate within a round (before, after, before, after ...), so a drift of the shared host's
speed hits both alike. The ``--before`` build is the commit's ``libs/`` and ``services/``
(``git archive``) put first on the services' ``PYTHONPATH``; the load generator (this process)
is the same for both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench._common import machine_info, machine_line, thread_cpu_seconds
from bench.analysis import Stats
from bench.controlplane import cycle_throughput, handoff_latency
from bench.grpc_floor import round_trip_after_idle
from timeslice_orchestrator.store.etcd import EtcdClient, Put, Txn, absent
from timeslice_tools.dev.etcd import EtcdServer

_ROOT = Path(__file__).resolve().parent.parent
_FLOOR_SAMPLES = 500
_FLOOR_IN_FLIGHT = 100
_FLOOR_BATCH = 5000
# The pause before each transaction of the after-idle floor.
_FLOOR_IDLE_SECONDS = 0.002
# Samples of each round's handoff floor (each kind).
_ROUND_FLOOR_SAMPLES = 200
TARGETS = {
    "cycles_per_second": ">= 500",
    "replica_cpu_ms_per_cycle": "<= 2",
    "handoff_p50_ms": "<= 3",
    "handoff_p99_ms": "<= 15",
}


@dataclass
class Floor:
    """etcd on this machine, through the orchestrator's client, from this process."""

    put_ms: Stats
    txn_ms: Stats
    lease_grant_ms: Stats
    txn_per_second: float  # compare-and-put transactions, 100 in flight
    # One transaction after the process sat idle a moment, as each of a hand-over's is: the
    # wake-ups of both processes (and of gRPC's threads) count, which back to back hides.
    txn_after_idle_ms: Stats | None = None
    # This process's CPU per back-to-back transaction, by thread name: what the client costs.
    client_cpu_ms_per_txn: dict[str, float] = field(default_factory=dict)
    # A gRPC round trip (grpclib, a server doing no work) after the same idling: a hand-over
    # crosses gRPC twice, in and out, so this plus one transaction after idling is the least
    # a handoff can take on this machine (bench.grpc_floor).
    grpc_after_idle_ms: Stats | None = None

    @property
    def handoff_floor_ms(self) -> float | None:
        """One gRPC round trip and one etcd transaction, each after idling (p50s)."""
        if self.grpc_after_idle_ms is None or self.txn_after_idle_ms is None:
            return None
        return self.grpc_after_idle_ms.p50 + self.txn_after_idle_ms.p50


@dataclass
class BuildRun:
    build: str
    cycles_per_second: float
    replica_cpu_ms_per_cycle: float
    cpu_ms_per_cycle: dict[str, float]  # every process by role (etcd, the load generator...)
    cycle_ms: Stats
    handoff_ms: Stats
    yield_call_ms: Stats
    violations: list[str]
    # The handoff floor measured just before this round (the host's speed drifts within a
    # run): one gRPC round trip and one etcd transaction, each after idling (p50s, ms).
    round_floor_ms: float | None = None


async def measure_handoff_floor(samples: int = _ROUND_FLOOR_SAMPLES) -> float:
    """The handoff floor now: p50 of a gRPC round trip plus p50 of an etcd transaction, each
    after idling (a private etcd; see Floor.handoff_floor_ms)."""
    with tempfile.TemporaryDirectory(prefix="timeslice-floor-") as scratch:
        server = EtcdServer(Path(scratch))
        await asyncio.to_thread(server.start)
        client = EtcdClient([server.endpoint])
        try:
            times = []
            for i in range(20 + samples):
                await asyncio.sleep(_FLOOR_IDLE_SECONDS)
                key = f"/floor/round/{i}".encode()
                t0 = time.perf_counter()
                await client.txn(Txn([absent(key)], [Put(key, b"x")]))
                if i >= 20:
                    times.append(time.perf_counter() - t0)
        finally:
            await client.close()
            await asyncio.to_thread(server.close)
    grpc = await round_trip_after_idle(_FLOOR_IDLE_SECONDS, samples)
    return grpc.p50 + Stats.of(times).scaled(1000).p50


async def measure_floor() -> Floor:
    """Round trips and throughput of a private etcd (same binary and flags as the clusters)."""
    with tempfile.TemporaryDirectory(prefix="timeslice-floor-") as scratch:
        server = EtcdServer(Path(scratch))
        await asyncio.to_thread(server.start)
        client = EtcdClient([server.endpoint])
        try:
            floor = await _floor(client)
        finally:
            await client.close()
            await asyncio.to_thread(server.close)
    floor.grpc_after_idle_ms = await round_trip_after_idle(_FLOOR_IDLE_SECONDS, _FLOOR_SAMPLES)
    return floor


async def _floor(client: EtcdClient) -> Floor:
    async def timed(make: Any, pause: float = 0.0) -> Stats:
        for i in range(20):  # warm the channel up
            await make(-i - 1)
        samples = []
        for i in range(_FLOOR_SAMPLES):
            if pause:
                await asyncio.sleep(pause)
            t0 = time.perf_counter()
            await make(i)
            samples.append(time.perf_counter() - t0)
        return Stats.of(samples).scaled(1000)

    async def put(i: int) -> None:
        await client.put(f"/floor/put/{i}".encode(), b"x")

    async def txn(i: int) -> None:
        key = f"/floor/txn/{i}".encode()
        await client.txn(Txn([absent(key)], [Put(key, b"x")]))

    async def txn_after_idle(i: int) -> None:
        key = f"/floor/idle/{i}".encode()
        await client.txn(Txn([absent(key)], [Put(key, b"x")]))

    async def grant(i: int) -> None:
        await client.grant_lease(30)

    put_ms, grant_ms = await timed(put), await timed(grant)
    cpu0 = thread_cpu_seconds()
    txn_ms = await timed(txn)
    cpu1 = thread_cpu_seconds()
    client_cpu = {
        name: round(1000 * (spent - cpu0.get(name, 0.0)) / (_FLOOR_SAMPLES + 20), 3)
        for name, spent in cpu1.items()
        if spent > cpu0.get(name, 0.0)
    }
    idle_ms = await timed(txn_after_idle, _FLOOR_IDLE_SECONDS)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(_FLOOR_BATCH):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            key = f"/floor/many/{queue.get_nowait()}".encode()
            await client.txn(Txn([absent(key)], [Put(key, b"x")]))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(_FLOOR_IN_FLIGHT)))
    rate = _FLOOR_BATCH / (time.perf_counter() - t0)
    return Floor(put_ms, txn_ms, grant_ms, rate, idle_ms, client_cpu)


def export_build(commit: str, into: Path) -> Path:
    """``libs/`` and ``services/`` of ``commit``, unpacked under ``into``."""
    into.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(_ROOT), "archive", commit, "libs", "services"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


async def run_build(build: str, pythonpath: str | None, seconds: float, samples: int) -> BuildRun:
    kwargs: dict[str, Any] = {}
    if pythonpath is not None:
        kwargs["cluster_kwargs"] = {"env": {"PYTHONPATH": pythonpath}}
    cycles = await cycle_throughput(100, 1, seconds=seconds, **kwargs)
    handoff = await handoff_latency(1, samples, **kwargs)
    return BuildRun(
        build=build,
        cycles_per_second=cycles.cycles_per_second,
        replica_cpu_ms_per_cycle=cycles.cpu_ms_per_cycle.get("orchestrator", float("nan")),
        cpu_ms_per_cycle=cycles.cpu_ms_per_cycle,
        cycle_ms=cycles.cycle_ms,
        handoff_ms=handoff.handoff_ms,
        yield_call_ms=handoff.yield_call_ms,
        violations=cycles.violations + handoff.violations,
    )


def _row(run: BuildRun) -> str:
    return (
        f"| {run.build} | {run.cycles_per_second:.0f} | {run.replica_cpu_ms_per_cycle:.2f} | "
        f"{run.cycle_ms.p50:.2f} | {run.handoff_ms.p50:.2f} | {run.handoff_ms.p99:.2f} | "
        f"{run.yield_call_ms.p50:.2f} | {_cpu(run)} | {len(run.violations)} | "
        f"{_ratio(run)} |"
    )


def _ratio(run: BuildRun) -> str:
    """The handoff p50 over the round's floor (and the floor), or '-' without one."""
    if not run.round_floor_ms:
        return "-"
    return f"{run.handoff_ms.p50 / run.round_floor_ms:.2f}x of {run.round_floor_ms:.2f}"


def _cpu(run: BuildRun) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(run.cpu_ms_per_cycle.items()))


def _over_floor(runs: list[BuildRun]) -> str:
    ratios = [r.handoff_ms.p50 / r.round_floor_ms for r in runs if r.round_floor_ms]
    if not ratios:
        return ""
    return f" ({statistics.median(ratios):.2f}x the round's handoff floor)"


def report(floor: Floor, runs: list[BuildRun]) -> str:
    lines = [
        "etcd floor (this process, the orchestrator's client, private etcd):",
        f"  put        p50 {floor.put_ms.p50:.3f} ms  p99 {floor.put_ms.p99:.3f} ms",
        f"  txn        p50 {floor.txn_ms.p50:.3f} ms  p99 {floor.txn_ms.p99:.3f} ms",
        f"  lease grant p50 {floor.lease_grant_ms.p50:.3f} ms  p99 "
        f"{floor.lease_grant_ms.p99:.3f} ms",
        f"  txn/s, {_FLOOR_IN_FLIGHT} in flight: {floor.txn_per_second:.0f}",
        *(
            [
                f"  txn after {_FLOOR_IDLE_SECONDS * 1000:g} ms idle p50 "
                f"{floor.txn_after_idle_ms.p50:.3f} ms  p99 {floor.txn_after_idle_ms.p99:.3f} ms"
            ]
            if floor.txn_after_idle_ms is not None
            else []
        ),
        *(
            [
                f"  gRPC round trip after {_FLOOR_IDLE_SECONDS * 1000:g} ms idle p50 "
                f"{floor.grpc_after_idle_ms.p50:.3f} ms  p99 {floor.grpc_after_idle_ms.p99:.3f} ms",
                f"  handoff floor (one of each, after idling): {floor.handoff_floor_ms:.2f} ms",
            ]
            if floor.grpc_after_idle_ms is not None and floor.handoff_floor_ms is not None
            else []
        ),
        *(
            [
                f"  client CPU per txn: {sum(floor.client_cpu_ms_per_txn.values()):.3f} ms ("
                + ", ".join(f"{k} {v:.3f}" for k, v in sorted(floor.client_cpu_ms_per_txn.items()))
                + ")"
            ]
            if floor.client_cpu_ms_per_txn
            else []
        ),
        "",
        "| build | cycles/s (100 groups, 1 replica) | replica CPU ms/cycle | cycle p50 ms "
        "| handoff p50 ms | handoff p99 ms | yield call p50 ms | CPU ms/cycle by process "
        "| violations | handoff / round's floor (ms) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_row(r) for r in runs),
    ]
    builds = sorted({r.build for r in runs}, key=[r.build for r in runs].index)
    if runs:
        lines.append("")
        lines.append("medians over rounds:" if len(runs) > len(builds) else "per build:")
        for build in builds:
            mine = [r for r in runs if r.build == build]
            lines.append(
                f"  {build}: cycles/s {statistics.median(r.cycles_per_second for r in mine):.0f}"
                f", replica CPU ms/cycle "
                f"{statistics.median(r.replica_cpu_ms_per_cycle for r in mine):.2f}"
                f", handoff p50 {statistics.median(r.handoff_ms.p50 for r in mine):.2f} ms"
                f", p99 {statistics.median(r.handoff_ms.p99 for r in mine):.2f} ms"
                + _over_floor(mine)
            )
    lines.append("")
    lines.append("targets: " + ", ".join(f"{k} {v}" for k, v in TARGETS.items()))
    return "\n".join(lines)


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--before", action="append", default=[], help="a commit to measure beside this tree"
    )
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=6.0, help="cycle window per run")
    parser.add_argument("--samples", type=int, default=200, help="handoffs per run")
    parser.add_argument("--json", type=Path, help="write every number here")
    args = parser.parse_args(argv)
    here = os.environ.get("PYTHONPATH")
    with tempfile.TemporaryDirectory(prefix="timeslice-before-") as scratch:
        builds: list[tuple[str, str | None]] = []
        for commit in args.before:
            tree = export_build(commit, Path(scratch) / commit)
            pythonpath = os.pathsep.join(p for p in (f"{tree}/libs", f"{tree}/services", here) if p)
            builds.append((commit, pythonpath))
        builds.append(("this tree", None))
        floor = await measure_floor()
        runs = []
        for _ in range(args.rounds):
            least = await measure_handoff_floor()
            for name, path in builds:
                runs.append(await run_build(name, path, args.seconds, args.samples))
                runs[-1].round_floor_ms = least
                print(_row(runs[-1]), file=sys.stderr, flush=True)
    machine = machine_info()
    print(machine_line(machine))
    print(report(floor, runs))
    if args.json is not None:
        data = {
            "machine": machine,
            "floor": {**asdict(floor), "handoff_floor_ms": floor.handoff_floor_ms},
            "runs": [asdict(r) for r in runs],
        }
        args.json.write_text(json.dumps(data, indent=2))
    return 1 if any(r.violations for r in runs) else 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
