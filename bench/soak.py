"""Soak under replica churn: jobs cycle through the real stack while replicas are killed.

    python -m bench.soak --duration 600            # the 10-minute soak
    python -m bench.soak --duration 90             # the CI-sized one (tests/faults)

3 orchestrator replicas, 2 agents (sim backend, emulated data movement), 6 jobs registered on
both nodes sharing one group. Every 20-40 s one fault, in turn: a random replica is killed with
SIGKILL and started again a second later; etcd is paused (SIGSTOP, then SIGCONT) for 0.5-1.5 s,
well under every lease TTL; a random agent is paused for 1-3 s. At the end the recorded history
is checked for the invariants of docs/design.md section 5 (any violation fails the run) and a JSON
report is printed (and written with --out). etcd is paused only when the soak runs its own.
A wait is bounded too: any acquire longer than ``--max-wait`` (20 s: a replica kill costs a
lease TTL of 4 s and a reconnect), or longer than ``--max-quiet-wait`` (15 s) with no fault
overlapping it, is a violation (a wait that long is a liveness bug, not an outage ridden out).

The report lists every fault with its time (seconds from the start), the longest waits with
the faults that overlapped them, so a long wait can be told apart from the outage it rode out,
and the waits split by the kind of fault they overlapped (``waits_by_fault``: how many, how
many over 2 s, p50, p99, max; ``none`` is the waits no fault touched, the soak's quiet p99);
``--keep DIR`` keeps the cluster's logs and journals there to read what happened.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from timeslice import AsyncTimeSliceClient, register
from timeslice_agent.journal import read_journal
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.history import (
    Attempt,
    Hold,
    Recorder,
    check_fencing,
    check_fifo,
    check_mutual_exclusion,
    check_nothing_lost,
    check_two_phase,
    percentile,
    wait_times,
)


@dataclass(frozen=True)
class FaultEvent:
    """One injected fault: when it began and ended (seconds from the start of the load)."""

    kind: str  # "kill" (a replica, SIGKILL then started again), "etcd" or "agent" (paused)
    target: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class LongWait:
    """One of the longest acquires, and the faults that overlapped it."""

    job: str
    start_s: float
    wait_s: float
    faults: list[str]


# A wait this long is listed by the faults it overlapped (a quiet soak's p99 is under 2 s).
LONG_WAIT_S = 2.0
QUIET = "none"  # the fault kind of a wait that no fault overlapped


@dataclass(frozen=True)
class FaultWaits:
    """The granted waits that one kind of fault overlapped (or none did: ``QUIET``)."""

    waits: int
    over_2s: int
    p50_s: float
    p99_s: float
    max_s: float


@dataclass
class SoakReport:
    duration_s: float
    replicas: int
    agents: int
    jobs: int
    kills: int = 0
    etcd_pauses: int = 0
    agent_pauses: int = 0
    switches: int = 0
    grants: int = 0
    phases_per_job: dict[str, int] = field(default_factory=dict)
    job_errors: dict[str, str] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    wait_p50_s: float = 0.0
    wait_p99_s: float = 0.0
    wait_max_s: float = 0.0
    faults: list[FaultEvent] = field(default_factory=list)
    longest_waits: list[LongWait] = field(default_factory=list)
    # Waits split by the kinds of fault they overlapped ("kill", "etcd", "agent", "none"; a
    # wait that overlapped two kinds counts for both): tells a change in how long waits are
    # apart from a change in how many of them a run's faults happened to catch.
    waits_by_fault: dict[str, FaultWaits] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return (
            not self.violations
            and not self.job_errors
            and len(self.phases_per_job) == self.jobs
            and all(n > 0 for n in self.phases_per_job.values())
        )


async def _job(
    client: AsyncTimeSliceClient, recorder: Recorder, stop: asyncio.Event, seed: int
) -> int:
    rng = random.Random(seed)
    phases = 0
    while not stop.is_set():
        started = recorder.now()
        try:
            grant = await client.acquire("soak", timeout=120)
        except Exception as exc:
            recorder.attempt(Attempt(client.job_id, "soak", started, None, repr(exc)))
            raise
        granted = recorder.now()
        recorder.attempt(Attempt(client.job_id, "soak", started, granted))
        await asyncio.sleep(rng.uniform(0.01, 0.08))  # the accelerator phase
        released = recorder.now()
        recorder.hold(Hold(client.job_id, "soak", grant.epoch, grant.ticket, granted, released))
        await client.yield_("soak")
        phases += 1
        await asyncio.sleep(rng.uniform(0.01, 0.12))  # rewards, off the accelerator
    return phases


ETCD_PAUSE = (0.5, 1.5)  # seconds: well under the replicas' and sessions' lease TTLs
AGENT_PAUSE = (1.0, 3.0)  # under the agents' TTL and the directive deadline


async def _paused(pid: int, seconds: float) -> None:
    """SIGSTOP ``pid`` for ``seconds``; SIGCONT it whatever happens meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


async def _faults(
    cluster: LocalCluster,
    report: SoakReport,
    stop: asyncio.Event,
    every: tuple[float, float],
    rng: random.Random,
    t0: float,
) -> None:
    """One fault every ``every`` seconds, in turn: a replica kill, an etcd pause (when the
    cluster runs its own etcd), an agent pause."""
    kinds = ["kill", "etcd", "agent"] if cluster.etcd is not None else ["kill", "agent"]
    turn = 0
    while True:
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(*every))
            return
        except TimeoutError:
            pass
        kind = kinds[turn % len(kinds)]
        turn += 1
        began = Recorder.now()
        if kind == "kill":
            victim = rng.randrange(len(cluster.replica_ids))
            target = cluster.replica_ids[victim]
            cluster.kill_replica(victim)
            report.kills += 1
            print(f"[soak] killed {target} (kill {report.kills})", flush=True)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(cluster.start_replica, victim)
        elif kind == "etcd":
            assert cluster.etcd is not None and cluster.etcd.pid is not None
            target = "etcd"
            seconds = rng.uniform(*ETCD_PAUSE)
            print(f"[soak] pausing etcd for {seconds:.1f} s", flush=True)
            await _paused(cluster.etcd.pid, seconds)
            report.etcd_pauses += 1
        else:
            target = rng.choice(cluster.nodes)
            pid = cluster.processes[target].pid
            seconds = rng.uniform(*AGENT_PAUSE)
            print(f"[soak] pausing agent {target} for {seconds:.1f} s", flush=True)
            await _paused(pid, seconds)
            report.agent_pauses += 1
        report.faults.append(FaultEvent(kind, target, began - t0, Recorder.now() - t0))


@dataclass(frozen=True)
class WaitBounds:
    """How long an acquire may wait: at all, and with no fault overlapping it."""

    any_s: float = 20.0
    quiet_s: float = 15.0


def _overlapping(faults: list[FaultEvent], start: float, end: float) -> list[str]:
    return [
        f"{f.kind} {f.target} {f.start_s:.1f}-{f.end_s:.1f}"
        for f in faults
        if f.start_s < end and f.end_s > start
    ]


def wait_violations(
    attempts: list[Attempt], faults: list[FaultEvent], t0: float, bounds: WaitBounds
) -> list[str]:
    """Every granted wait over its bound, with the faults it overlapped (times from ``t0``)."""
    out = []
    for a in attempts:
        if a.granted_at is None:
            continue
        wait = a.granted_at - a.started_at
        start = a.started_at - t0
        during = _overlapping(faults, start, start + wait)
        bound = bounds.any_s if during else bounds.quiet_s
        if wait > bound:
            with_faults = f"during {', '.join(during)}" if during else "with no fault overlapping"
            out.append(
                f"wait_bound: {a.job} waited {wait:.1f} s from {start:.1f} s, {with_faults} "
                f"(bound {bound:g} s)"
            )
    return out


def _longest_waits(
    attempts: list[Attempt], faults: list[FaultEvent], t0: float, count: int = 5
) -> list[LongWait]:
    """The ``count`` longest granted waits, each with the faults that overlapped it."""
    waits = [(a.granted_at - a.started_at, a) for a in attempts if a.granted_at is not None]
    waits.sort(key=lambda item: item[0])
    out = []
    for wait, a in reversed(waits[-count:]):
        start = a.started_at - t0
        overlapping = _overlapping(faults, start, start + wait)
        out.append(LongWait(a.job, round(start, 2), round(wait, 3), overlapping))
    return out


def waits_by_fault(
    attempts: list[Attempt], faults: list[FaultEvent], t0: float
) -> dict[str, FaultWaits]:
    """Every granted wait under each kind of fault it overlapped, or under ``QUIET``."""
    split: dict[str, list[float]] = {}
    for a in attempts:
        if a.granted_at is None:
            continue
        wait = a.granted_at - a.started_at
        start = a.started_at - t0
        kinds = {f.kind for f in faults if f.start_s < start + wait and f.end_s > start}
        for kind in kinds or {QUIET}:
            split.setdefault(kind, []).append(wait)
    return {
        kind: FaultWaits(
            waits=len(waits),
            over_2s=sum(w > LONG_WAIT_S for w in waits),
            p50_s=round(percentile(waits, 0.5), 3),
            p99_s=round(percentile(waits, 0.99), 3),
            max_s=round(max(waits), 3),
        )
        for kind, waits in sorted(split.items())
    }


async def soak(
    duration: float,
    *,
    replicas: int = 3,
    agents: int = 2,
    jobs: int = 6,
    every: tuple[float, float] = (20.0, 40.0),
    seed: int = 1,
    etcd_endpoint: str | None = None,
    base_dir: Path | None = None,
    wait_bounds: WaitBounds = WaitBounds(),
) -> SoakReport:
    rng = random.Random(seed)
    report = SoakReport(duration, replicas, agents, jobs)
    recorder = Recorder()
    names = [f"job-{i}" for i in range(jobs)]
    with LocalCluster(
        replicas=replicas,
        agents=agents,
        etcd_endpoint=etcd_endpoint,
        base_dir=base_dir,
        # Above the longest etcd pause, so that a pause is an outage the replicas ride out.
        replica_ttl=4,
        agent_args=["--sim-state-gb", "0.5"],
        orchestrator_args=["--agent-ttl", "5"],
    ) as cluster:
        workers = [
            register("soak", job_id=j, socket=str(cluster.agent_sockets[n]))
            for j in names
            for n in cluster.nodes
        ]
        clients = [
            AsyncTimeSliceClient(cluster.targets, job_id=j, **cluster.client_tls) for j in names
        ]
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(_job(c, recorder, stop, seed + i)) for i, c in enumerate(clients)
        ]
        t0 = Recorder.now()
        faults = asyncio.create_task(_faults(cluster, report, stop, every, rng, t0))
        await asyncio.sleep(duration)
        stop.set()
        await faults
        results = await asyncio.gather(*tasks, return_exceptions=True)
        for name, result in zip(names, results, strict=True):
            if isinstance(result, BaseException):
                report.job_errors[name] = repr(result)
            else:
                report.phases_per_job[name] = result
        for c in clients:
            await c.close()
        for w in workers:
            w.close()
        entries = [e for p in cluster.agent_journals.values() for e in read_journal(p)]
        nodes = list(cluster.nodes)
    expected = {name: 1 for name in names}
    checks: list[tuple[str, Callable[[], object]]] = [
        ("check_mutual_exclusion", lambda: check_mutual_exclusion(recorder.holds)),
        ("check_fifo", lambda: check_fifo(recorder.holds)),
        ("check_nothing_lost", lambda: check_nothing_lost(recorder.attempts, expected)),
        ("check_fencing", lambda: check_fencing(entries, nodes=nodes)),
        # Rollbacks share their switch's epoch; the checker tells them apart.
        ("check_two_phase", lambda: check_two_phase(entries)),
    ]
    for name, check in checks:
        try:
            check()
        except AssertionError as exc:
            report.violations.append(f"{name}: {exc}")
    report.grants = len(recorder.holds)
    report.switches = len(
        {(e.group, e.epoch) for e in entries if e.kind == "checkpoint" and e.status == "ok"}
    )
    waits = wait_times(recorder.attempts)
    report.wait_p50_s = percentile(waits, 0.5)
    report.wait_p99_s = percentile(waits, 0.99)
    report.wait_max_s = waits[-1] if waits else 0.0
    report.longest_waits = _longest_waits(recorder.attempts, report.faults, t0)
    report.waits_by_fault = waits_by_fault(recorder.attempts, report.faults, t0)
    report.violations += wait_violations(recorder.attempts, report.faults, t0, wait_bounds)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument(
        "--every",
        type=float,
        nargs=2,
        default=(20.0, 40.0),
        metavar=("MIN", "MAX"),
        help="seconds between faults (replica kill, etcd pause, agent pause, in turn)",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--max-wait", type=float, default=WaitBounds.any_s, help="seconds any acquire may wait"
    )
    parser.add_argument(
        "--max-quiet-wait",
        type=float,
        default=WaitBounds.quiet_s,
        help="seconds an acquire may wait when no fault overlaps it",
    )
    parser.add_argument("--out", type=Path, help="write the JSON report here too")
    parser.add_argument(
        "--keep", type=Path, metavar="DIR", help="run the cluster in DIR and keep its logs there"
    )
    args = parser.parse_args()
    started = time.monotonic()
    report = asyncio.run(
        soak(
            args.duration,
            every=tuple(args.every),
            seed=args.seed,
            base_dir=args.keep,
            wait_bounds=WaitBounds(args.max_wait, args.max_quiet_wait),
        )
    )
    data = {**asdict(report), "ok": report.ok, "wall_s": time.monotonic() - started}
    text = json.dumps(data, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
