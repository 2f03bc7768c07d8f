"""Control-plane benchmarks: handoff latency, acquire/yield throughput, memory, switch fan-out.

Every benchmark starts its own :class:`~timeslice_tools.dev.cluster.LocalCluster` (real etcd,
orchestrator replicas and agents as processes, loopback gRPC) and drives it through the SDK
from this process, so the client side's CPU is part of what is measured: on a 2-core
machine the load generator, etcd, the replicas and the agents compete for the same cores.
Each records CPU seconds per process over its measured window, which says what dominates.

* :func:`handoff_latency` - a holder yields while another job waits: from the yield call to
  the waiter's grant. No data moves (the jobs register no workers).
* :func:`cycle_throughput` - acquire -> yield in closed loops over N groups (one job per
  group, at most 100 acquires in flight): cycles per second against groups and replicas.
* :func:`memory_per_group` - a replica's resident memory (``VmRSS``) before and after
  creating N groups.
* :func:`switch_fanout` - context switches across 1..16 nodes with free data movement
  (``--sim-time-scale 0``): switch wall time minus the slowest node's backend time per phase.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pstats
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench._common import (
    close_workers,
    cluster_pids,
    cpu_by_role,
    cpu_seconds,
    proc_sample,
    register_workers,
    rotated,
    running_cluster,
)
from bench.analysis import GrantSample, Stats, split_switches
from timeslice import AcquireProgress, AcquireStage, AsyncTimeSliceClient, Grant
from timeslice_agent.journal import read_journal
from timeslice_tools.history import (
    Hold,
    Recorder,
    check_fencing,
    check_fifo,
    check_mutual_exclusion,
    check_two_phase,
)

__all__ = [
    "CyclesResult",
    "FanoutResult",
    "HandOver",
    "HandoffResult",
    "MemoryResult",
    "cycle_throughput",
    "hand_over_once",
    "handoff_latency",
    "memory_per_group",
    "profile_orchestrator",
    "switch_fanout",
]

_CALL_TIMEOUT = 30.0
# After the waiter is queued, give every replica's mirror time to see the queue entry, so
# the measured handoff starts from a settled state (the yield is the only thing happening).
_SETTLE_SECONDS = 0.005
# Driver loops of idle groups end after the orchestrator's idle recheck (2 s): memory is
# read once they have.
_MEMORY_SETTLE_SECONDS = 3.0
_CREATE_CONCURRENCY = 64
_STATUS_SAMPLES = 100
_CREATE_TIMEOUT = 120.0


def _violations(recorder: Recorder, journal: Sequence[Any] | None = None) -> list[str]:
    """The invariants a run can show: holds always (each recorded from the acquire's return
    to the call of its yield), the agents' journals only when the run had agents (``None``:
    fencing and two-phase are not checked, and the reports say so)."""
    out: list[str] = []
    checks: list[tuple[str, Callable[[], object]]] = [
        ("mutual_exclusion", lambda: check_mutual_exclusion(recorder.holds)),
        ("fifo", lambda: check_fifo(recorder.holds)),
    ]
    if journal is not None:
        checks += [
            ("fencing", lambda: check_fencing(list(journal))),
            ("two_phase", lambda: check_two_phase(list(journal))),
        ]
    for name, check in checks:
        try:
            check()
        except AssertionError as exc:
            out.append(f"{name}: {exc}")
    return out


async def _close_all(clients: Sequence[AsyncTimeSliceClient]) -> None:
    await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


# -- handoff ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class HandOver:
    """One measured hand-over (see :func:`hand_over_once`)."""

    grant: Grant  # the waiter's
    released_at: float  # time.monotonic() just before the yield (the holder's hold ends)
    yield_seconds: float  # the yield call alone
    handoff_seconds: float  # from calling yield to the waiter's acquire returning


async def hand_over_once(
    holder: AsyncTimeSliceClient, waiter: AsyncTimeSliceClient, group: str
) -> HandOver:
    """``waiter`` queues for ``group``, which ``holder`` holds; once it is queued and the
    replicas' mirrors have settled, ``holder`` yields. Measures that yield to the grant."""
    queued = asyncio.Event()

    def progress(p: AcquireProgress) -> None:
        if p.state is AcquireStage.QUEUED:
            queued.set()

    async def wait_grant() -> tuple[Grant, float]:
        g = await waiter.acquire(group, timeout=_CALL_TIMEOUT, on_progress=progress)
        return g, time.perf_counter()

    task = asyncio.create_task(wait_grant())
    try:
        async with asyncio.timeout(_CALL_TIMEOUT):
            await queued.wait()
        await asyncio.sleep(_SETTLE_SECONDS)
        released_at = time.monotonic()
        t0 = time.perf_counter()
        await holder.yield_(group)
        t_yield = time.perf_counter()
        async with asyncio.timeout(_CALL_TIMEOUT):
            grant, t1 = await task
    except BaseException:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise
    return HandOver(grant, released_at, t_yield - t0, t1 - t0)


@dataclass
class HandoffResult:
    """Yield -> next waiter granted, no data movement."""

    replicas: int
    samples: int
    handoff_ms: Stats  # from calling yield to the waiter's acquire returning
    yield_call_ms: Stats  # the yield call alone (holder side)
    status_call_ms: Stats  # a GetGroupStatus round trip: the SDK -> replica floor (no etcd)
    cpu_seconds: dict[str, float]
    violations: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def handoff_latency(
    replicas: int,
    samples: int = 200,
    *,
    warmup: int = 10,
    cluster_kwargs: Mapping[str, Any] | None = None,
) -> HandoffResult:
    """Two jobs hand one group back and forth ``samples + warmup`` times.

    The holder and the waiter talk to different replicas when there are several (the switch
    driver may be a third), so with 3 replicas the measurement crosses replicas through etcd.
    """
    group = "handoff"
    recorder = Recorder()
    handoffs: list[float] = []
    yields: list[float] = []
    kwargs = {"replicas": replicas, "agents": 0, **(cluster_kwargs or {})}
    async with running_cluster(**kwargs) as cluster:
        clients = [
            AsyncTimeSliceClient(
                rotated(cluster.targets, i),
                job_id=f"handoff-{i}",
                call_timeout=_CALL_TIMEOUT,
                **cluster.client_tls,
            )
            for i in range(2)
        ]
        try:
            pids = cluster_pids(cluster)
            holder, waiter = clients
            grant = await holder.acquire(group, timeout=_CALL_TIMEOUT)
            granted_at = time.monotonic()
            cpu0 = cpu_seconds(pids)
            for i in range(samples + warmup):
                measured = await hand_over_once(holder, waiter, group)
                recorder.hold(
                    Hold(
                        holder.job_id,
                        group,
                        grant.epoch,
                        grant.ticket,
                        granted_at,
                        measured.released_at,
                    )
                )
                grant, granted_at = measured.grant, time.monotonic()
                if i >= warmup:
                    handoffs.append(measured.handoff_seconds)
                    yields.append(measured.yield_seconds)
                holder, waiter = waiter, holder
            cpu = cpu_by_role(cpu0, cpu_seconds(pids))
            await holder.yield_(group)
            statuses: list[float] = []
            for _ in range(_STATUS_SAMPLES):
                t0 = time.perf_counter()
                await holder.status(group)
                statuses.append(time.perf_counter() - t0)
        finally:
            await _close_all(clients)
    return HandoffResult(
        replicas=replicas,
        samples=len(handoffs),
        handoff_ms=Stats.of(handoffs).scaled(1000),
        yield_call_ms=Stats.of(yields).scaled(1000),
        status_call_ms=Stats.of(statuses).scaled(1000),
        cpu_seconds=cpu,
        violations=_violations(recorder),
    )


# -- acquire/yield throughput ------------------------------------------------------------------


@dataclass
class CyclesResult:
    """Closed-loop acquire -> yield cycles, one job per group, all groups concurrently."""

    groups: int
    replicas: int
    clients: int
    in_flight: int  # acquire loops running at once
    seconds: float
    cycles: int
    cycles_per_second: float
    cycle_ms: Stats  # one acquire + yield, as the job sees it
    cpu_seconds: dict[str, float]  # by role over the measured window
    cpu_ms_per_cycle: dict[str, float]
    violations: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def cycle_throughput(
    groups: int,
    replicas: int,
    *,
    seconds: float = 6.0,
    warmup: float = 2.0,
    clients: int = 16,
    in_flight: int = 100,
    cluster_kwargs: Mapping[str, Any] | None = None,
) -> CyclesResult:
    """Acquire/yield cycles per second with ``groups`` groups and ``replicas`` replicas.

    ``min(groups, in_flight)`` loops run at once; loop ``w`` cycles groups ``w``,
    ``w + loops``, ... in turn, so every group is in use and at most ``in_flight`` acquires
    are outstanding. ``clients`` jobs (sessions) share the loops round-robin; each group is
    only ever acquired by one job, so no acquire waits for another job: this is the
    uncontended grant path at a bounded concurrency. Counting starts once every group has
    been created (acquired once) and ``warmup`` seconds have passed.
    """
    loops = max(1, min(groups, in_flight))
    n_clients = max(1, min(clients, loops))
    recorder = Recorder()
    kwargs = {"replicas": replicas, "agents": 0, **(cluster_kwargs or {})}
    async with running_cluster(**kwargs) as cluster:
        pool = [
            AsyncTimeSliceClient(
                rotated(cluster.targets, i),
                job_id=f"cycle-{i}",
                call_timeout=_CALL_TIMEOUT,
                **cluster.client_tls,
            )
            for i in range(n_clients)
        ]
        counting = False
        stop = asyncio.Event()
        all_created = asyncio.Event()
        created: set[int] = set()
        count = 0
        latencies: list[float] = []

        async def cycle(index: int) -> None:
            nonlocal count
            client = pool[index % n_clients]
            mine = list(range(index, groups, loops))
            turn = 0
            while not stop.is_set():
                number = mine[turn % len(mine)]
                turn += 1
                group = f"cycle-{number}"
                t0 = time.perf_counter()
                grant = await client.acquire(group, timeout=_CALL_TIMEOUT)
                held = time.monotonic()
                released = time.monotonic()  # before the yield is sent
                await client.yield_(group)
                recorder.hold(Hold(client.job_id, group, grant.epoch, grant.ticket, held, released))
                if counting:
                    count += 1
                    latencies.append(time.perf_counter() - t0)
                elif number not in created:
                    created.add(number)
                    if len(created) == groups:
                        all_created.set()

        try:
            pids = cluster_pids(cluster)
            tasks = [asyncio.create_task(cycle(w)) for w in range(loops)]
            try:
                await _event_or_fail(all_created, tasks, _CREATE_TIMEOUT)
                await _sleep_or_fail(warmup, tasks)
                counting = True
                cpu0 = cpu_seconds(pids)
                t0 = time.monotonic()
                await _sleep_or_fail(seconds, tasks)
                counting = False
                elapsed = time.monotonic() - t0
                cycles = count
                cpu = cpu_by_role(cpu0, cpu_seconds(pids))
                stop.set()
                async with asyncio.timeout(_CALL_TIMEOUT):
                    await asyncio.gather(*tasks)
            finally:
                stop.set()
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await _close_all(pool)
    return CyclesResult(
        groups=groups,
        replicas=replicas,
        clients=n_clients,
        in_flight=loops,
        seconds=elapsed,
        cycles=cycles,
        cycles_per_second=cycles / elapsed,
        cycle_ms=Stats.of(latencies).scaled(1000),
        cpu_seconds=cpu,
        cpu_ms_per_cycle={k: 1000 * v / max(1, cycles) for k, v in cpu.items()},
        violations=_violations(recorder),
    )


def _raise_first(done: set[asyncio.Task[Any]]) -> None:
    for t in done:
        error = None if t.cancelled() else t.exception()
        if error is not None:
            raise error


async def _sleep_or_fail(seconds: float, tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Sleep, but surface at once the first task that fails meanwhile."""
    done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
    _raise_first(done)


async def _event_or_fail(
    event: asyncio.Event, tasks: Sequence[asyncio.Task[Any]], timeout: float
) -> None:
    """Wait for ``event`` within ``timeout``; surface at once a task that fails meanwhile."""
    waiter = asyncio.create_task(event.wait())
    try:
        done, _ = await asyncio.wait(
            [*tasks, waiter], timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        waiter.cancel()
    _raise_first(done - {waiter})
    if not event.is_set():
        raise TimeoutError(f"not ready within {timeout:g} s")


# -- memory ----------------------------------------------------------------------------------


@dataclass
class MemoryResult:
    """A replica's resident memory after creating groups (one acquire + yield each)."""

    points: list[tuple[int, int]]  # (groups created, VmRSS bytes of the replica)
    bytes_per_group: list[float]  # per point: (rss - rss at 0 groups) / groups
    violations: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def memory_per_group(
    counts: Sequence[int] = (1000, 2000),
    *,
    clients: int = 8,
    cluster_kwargs: Mapping[str, Any] | None = None,
) -> MemoryResult:
    """RSS of the single replica at 0 groups, then after creating up to each of ``counts``."""
    if list(counts) != sorted(counts) or not counts or counts[0] < 1:
        raise ValueError("counts must be increasing positive group counts")
    recorder = Recorder()
    kwargs = {"replicas": 1, "agents": 0, **(cluster_kwargs or {})}
    async with running_cluster(**kwargs) as cluster:
        pool = [
            AsyncTimeSliceClient(
                cluster.targets, job_id=f"mem-{i}", call_timeout=_CALL_TIMEOUT, **cluster.client_tls
            )
            for i in range(clients)
        ]
        try:
            pid = cluster_pids(cluster)["r0"]

            async def touch(index: int) -> None:
                client = pool[index % clients]
                group = f"mem-{index}"
                grant = await client.acquire(group, timeout=_CALL_TIMEOUT)
                now = time.monotonic()
                released = time.monotonic()  # before the yield is sent
                await client.yield_(group)
                recorder.hold(Hold(client.job_id, group, grant.epoch, grant.ticket, now, released))

            # One warm-up cycle per client: sessions and connections are not groups.
            for c in pool:
                await c.acquire("mem-warmup", timeout=_CALL_TIMEOUT)
                await c.yield_("mem-warmup")
            await asyncio.sleep(_MEMORY_SETTLE_SECONDS)
            points = [(0, proc_sample(pid).rss_bytes)]
            created = 0
            for target in counts:
                await _bounded([touch(i) for i in range(created, target)], _CREATE_CONCURRENCY)
                created = target
                await asyncio.sleep(_MEMORY_SETTLE_SECONDS)
                points.append((created, proc_sample(pid).rss_bytes))
        finally:
            await _close_all(pool)
    base = points[0][1]
    return MemoryResult(
        points=points,
        bytes_per_group=[(rss - base) / n for n, rss in points[1:]],
        violations=_violations(recorder),
    )


async def _bounded(jobs: Sequence[Coroutine[Any, Any, None]], limit: int) -> None:
    """Await ``jobs`` with at most ``limit`` running at once; the first failure cancels all."""
    gate = asyncio.Semaphore(limit)

    async def one(job: Coroutine[Any, Any, None]) -> None:
        async with gate:
            await job

    async with asyncio.TaskGroup() as tasks:
        for job in jobs:
            tasks.create_task(one(job))


# -- switch fan-out --------------------------------------------------------------------------


@dataclass
class FanoutResult:
    """Context switches across ``nodes`` nodes with free (zero-time) emulated transfers."""

    nodes: int
    switches: int
    wall_ms: Stats  # Grant.switch_seconds: switch start to commit, orchestrator side
    backend_ms: Stats  # slowest node's checkpoint + slowest node's restore, agents' journals
    control_ms: Stats  # wall - backend: the control plane's own share
    acquire_ms: Stats  # the waiter's whole acquire call (includes the commit and the notice)
    cpu_seconds: dict[str, float]
    violations: list[str]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def switch_fanout(
    nodes: int,
    switches: int = 60,
    *,
    warmup: int = 4,
    cluster_kwargs: Mapping[str, Any] | None = None,
) -> FanoutResult:
    """Two jobs with workers on every node take turns: every grant is a context switch."""
    group = "fanout"
    jobs = ["fanout-a", "fanout-b"]
    recorder = Recorder()
    grants: list[GrantSample] = []
    acquires: list[float] = []
    extra = dict(cluster_kwargs or {})
    agent_args = ["--sim-time-scale", "0", *extra.pop("agent_args", ())]
    kwargs = {"replicas": 1, "agents": nodes, "agent_args": agent_args, **extra}
    async with running_cluster(**kwargs) as cluster:
        workers = await register_workers(cluster, [(j, group) for j in jobs])
        clients = [
            AsyncTimeSliceClient(
                cluster.targets, job_id=j, call_timeout=_CALL_TIMEOUT, **cluster.client_tls
            )
            for j in jobs
        ]
        try:
            pids = cluster_pids(cluster)
            cpu0 = cpu_seconds(pids)
            for i in range(switches + warmup):
                client = clients[i % 2]
                asked = time.time()
                t0 = time.perf_counter()
                grant = await client.acquire(group, timeout=_CALL_TIMEOUT)
                took = time.perf_counter() - t0
                granted = time.time()
                released = time.time()  # before the yield is sent
                await client.yield_(group)
                recorder.hold(
                    Hold(client.job_id, group, grant.epoch, grant.ticket, granted, released)
                )
                if i >= warmup:
                    acquires.append(took)
                    grants.append(
                        GrantSample(
                            job=client.job_id,
                            group=group,
                            step=i,
                            asked_at=asked,
                            granted_at=granted,
                            released_at=granted,
                            epoch=grant.epoch,
                            ticket=grant.ticket,
                            restored=grant.restored,
                            previous_job=grant.previous_job_id or "",
                            switch_seconds=grant.switch_seconds,
                            waited_seconds=grant.waited_seconds,
                        )
                    )
            cpu = cpu_by_role(cpu0, cpu_seconds(pids))
        finally:
            await _close_all(clients)
            await close_workers(workers)
        journal = [e for p in cluster.agent_journals.values() for e in read_journal(p)]
    splits = split_switches(grants, journal)
    return FanoutResult(
        nodes=nodes,
        switches=len(splits),
        wall_ms=Stats.of(s.wall for s in splits).scaled(1000),
        backend_ms=Stats.of(s.data for s in splits).scaled(1000),
        control_ms=Stats.of(s.control for s in splits).scaled(1000),
        acquire_ms=Stats.of(acquires).scaled(1000),
        cpu_seconds=cpu,
        violations=_violations(recorder, journal),
    )


# -- profiling -------------------------------------------------------------------------------

PROFILER_DIR = Path(__file__).resolve().parent / "profiler"


@dataclass(frozen=True)
class ProfileRow:
    """One function in a cProfile of the replica: its own time's share, calls, cumulative."""

    function: str
    own_share: float  # of all own time in the profile
    own_seconds: float
    cumulative_seconds: float
    calls: int


@dataclass
class ProfileResult:
    """Where a replica's CPU goes while serving the acquire/yield cycle benchmark."""

    groups: int
    cycles_per_second: float  # under the profiler (slower than unprofiled)
    profiled_seconds: float
    top: list[ProfileRow]
    by_area: dict[str, float]  # share of own time by code area (see _AREAS)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _short(path: str) -> str:
    for marker in ("site-packages/", "services/", "libs/", "python3.11/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


async def profile_orchestrator(
    groups: int = 100, *, seconds: float = 6.0, top: int = 15, keep_in: Path | None = None
) -> ProfileResult:
    """Run :func:`cycle_throughput` with the replica under cProfile; rank its functions.

    The profile covers the replica's whole life (start, warm-up, the measured window,
    shutdown); at this load the cycles dominate it. The raw ``pstats`` dump is kept in
    ``keep_in`` when given (for ``python -m pstats``), else thrown away.
    """
    with tempfile.TemporaryDirectory(prefix="timeslice-profile-") as scratch:
        work_dir = keep_in or Path(scratch)
        prefix = await asyncio.to_thread(_fresh_profile_dir, work_dir)
        path = os.pathsep.join(p for p in (str(PROFILER_DIR), os.environ.get("PYTHONPATH")) if p)
        env = {"PYTHONPATH": path, "TIMESLICE_BENCH_PROFILE": str(prefix)}
        result = await cycle_throughput(groups, 1, seconds=seconds, cluster_kwargs={"env": env})
        total, rows, areas = await asyncio.to_thread(_rank_profile, work_dir, top)
    return ProfileResult(groups, result.cycles_per_second, total, rows, areas)


def _fresh_profile_dir(work_dir: Path) -> Path:
    work_dir.mkdir(parents=True, exist_ok=True)
    for old in work_dir.glob("replica.prof.*"):
        old.unlink()
    return work_dir / "replica.prof"


# Where a function's file lives says which part of the stack its own time belongs to.
_AREAS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("orchestrator code", ("timeslice_orchestrator/",)),
    ("etcd client (aetcd, grpcio)", ("/aetcd/", "/grpc/")),
    ("gRPC server (grpclib, h2)", ("/grpclib/", "/h2/", "/hpack/")),
    (
        "protobuf (betterproto2, protobuf)",
        ("/betterproto2/", "/google/protobuf/", "timeslice_proto/"),
    ),
    ("builtins (str, dict, ...)", ("~",)),
    ("Python stdlib (asyncio, json, ...)", ("/python3.11/",)),
)


def _area(path: str) -> str:
    for name, markers in _AREAS:
        if any(m in path if m != "~" else path == "~" for m in markers):
            return name
    return "other"


def _rank_profile(work_dir: Path, top: int) -> tuple[float, list[ProfileRow], dict[str, float]]:
    dumps = sorted(work_dir.glob("replica.prof.*"))
    if not dumps:
        raise RuntimeError(f"the replica wrote no profile under {work_dir}")
    stats = pstats.Stats(str(dumps[0]))
    for extra in dumps[1:]:
        stats.add(str(extra))
    # (file, line, function) -> (primitive calls, calls, own seconds, cumulative, callers)
    table = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in table.values()) or 1.0
    ranked = sorted(table.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    rows = [
        ProfileRow(
            function=f"{_short(file)}:{line}({func})",
            own_share=own / total,
            own_seconds=own,
            cumulative_seconds=cum,
            calls=calls,
        )
        for (file, line, func), (_, calls, own, cum, _) in ranked
    ]
    areas: dict[str, float] = {}
    for (file, _, _), value in table.items():
        areas[_area(file)] = areas.get(_area(file), 0.0) + value[2] / total
    return total, rows, dict(sorted(areas.items(), key=lambda kv: -kv[1]))
