"""The workload generator: synthetic RL jobs through the real SDK against a real LocalCluster.

:func:`run_profile` starts a :class:`~timeslice_tools.dev.cluster.LocalCluster` (etcd, orchestrator
replicas and sim agents as processes), then runs ``jobs`` copies of a profile twice with the
same random draws:

1. **dedicated** (the baseline): each job on a group of its own, all concurrently;
2. **shared**: every job on one group per role, time-sliced by the orchestrator.

Each job is an asyncio task with its own :class:`~timeslice.AsyncTimeSliceClient` (its own
session and connection) and one registered worker per node (``timeslice.register``), so every
context switch moves (emulated) device state through the agents. Each step draws its phase
durations from the profile (real seconds) and sleeps them multiplied by ``time_scale``; the sim
agents scale their modelled transfer time by the same factor (``--sim-time-scale``), so switch
cost and step length keep their real proportion. The control plane is not scaled: at a small
time scale it weighs more than it would in a real run (conservative).

Every run is also checked: mutual exclusion and FIFO on the recorded holds, fencing and
two-phase order on the agents' journals (:mod:`timeslice_tools.history`). A violation is reported in
:attr:`RunResult.violations`, never hidden.

The lead's scheduling comparisons pass orchestrator options through ``cluster_kwargs``
(``{"orchestrator_args": [...]}``) and SDK options through ``client_kwargs`` /
``acquire_kwargs``; the rest of the harness stays the same.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench._common import (
    SIM_LABEL,
    close_workers,
    register_workers,
    rotated,
    running_cluster,
    scrape_metrics,
)
from bench.analysis import (
    GrantSample,
    PhaseSample,
    Stats,
    active_window,
    analytic_duty_bound,
    analytic_step_ratio,
    duty_by_group,
    mean_step_seconds,
    split_switches,
)
from bench.model import ModelOutcome, simulate
from bench.profiles import DrawnHold, DrawnOff, JobDraws, Profile, StepPhase, StepPlan, draw_job
from timeslice import AsyncTimeSliceClient, Grant
from timeslice_agent.journal import JournalEntry, read_journal
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.history import (
    Attempt,
    Hold,
    Recorder,
    check_fencing,
    check_fifo,
    check_mutual_exclusion,
    check_two_phase,
)

__all__ = [
    "DEFAULT_COSTS",
    "REFERENCE_COSTS",
    "Baseline",
    "HoldRecord",
    "RunResult",
    "SimCosts",
    "WorkloadError",
    "arun_profile",
    "measure_baseline",
    "run_profile",
]

GB = 1_000_000_000
MODEL_LONG_STEPS = 400
_MIN_ACQUIRE_TIMEOUT = 60.0


class WorkloadError(RuntimeError):
    """A benchmark job failed (its error is in the message); the run's numbers are void."""


@dataclass(frozen=True)
class SimCosts:
    """The sim agents' model: device state per job and node, bandwidth per direction.

    A context switch checkpoints the resident job (state / bandwidth) then restores the next
    one (state / bandwidth again), on every node at once, so it costs ``2 * state /
    bandwidth`` real seconds; the agents multiply that by the run's time scale. ``instant``
    makes transfers free (``--sim-time-scale 0``).
    """

    state_gb: float = 40.0
    bandwidth_gbps: float = 50.0
    capacity_gb: float = 80.0
    label: str = "default (40 GB at 50 GB/s)"
    instant: bool = False

    def __post_init__(self) -> None:
        if self.state_gb < 0 or self.bandwidth_gbps <= 0 or self.capacity_gb <= 0:
            raise ValueError("state_gb >= 0, bandwidth_gbps > 0 and capacity_gb > 0 required")

    @property
    def switch_seconds(self) -> float:
        """Real seconds of data movement per switch (checkpoint + restore)."""
        return 0.0 if self.instant else 2 * self.state_gb / self.bandwidth_gbps

    def agent_args(self, time_scale: float) -> list[str]:
        return [
            "--sim-capacity-gb", f"{self.capacity_gb:g}",
            "--sim-bandwidth-gbps", f"{self.bandwidth_gbps:.9g}",
            "--sim-state-gb", f"{self.state_gb:g}",
            "--sim-time-scale", "0" if self.instant else f"{time_scale:.9g}",
        ]  # fmt: skip

    @classmethod
    def for_switch(cls, seconds: float, label: str, state_gb: float = 40.0) -> SimCosts:
        """Costs whose switch (checkpoint + restore) takes ``seconds`` real seconds.

        The sim model is symmetric (both directions at one bandwidth), so an asymmetric
        measured switch (say 21 s out + 7 s in) is modelled by its total, split evenly: the
        switch is on the critical path as a whole, so its total is what the duty cycle sees.
        """
        if seconds < 0:
            raise ValueError("seconds must be >= 0")
        if seconds == 0:
            return cls(state_gb=state_gb, label=label, instant=True)
        return cls(state_gb=state_gb, bandwidth_gbps=2 * state_gb / seconds, label=label)


DEFAULT_COSTS = SimCosts()
REFERENCE_COSTS = SimCosts.for_switch(28.0, "reference (21 s checkpoint + 7 s restore)")


@dataclass(frozen=True, slots=True)
class HoldRecord:
    """One hold for timelines: who held which group when (seconds from the run's start)."""

    job: str
    group: str
    start: float
    end: float


@dataclass(frozen=True)
class Baseline:
    """The dedicated baseline: each job alone on its own group, same draws as the shared run."""

    profile: str
    jobs: int
    steps: int
    seed: int
    time_scale: float
    warmup_steps: int
    step_seconds: list[float]  # mean step wall time per job index (bench seconds)
    duty: list[float]  # each job's duty cycle on its own group over its own steps
    violations: list[str] = field(default_factory=list)

    def covers(
        self,
        profile: Profile,
        jobs: int,
        steps: int,
        seed: int,
        time_scale: float,
        warmup_steps: int,
    ) -> bool:
        """Whether this baseline was measured for (at least) these jobs and settings."""
        return (
            self.profile == profile.name
            and self.jobs >= jobs
            and self.steps == steps
            and self.seed == seed
            and math.isclose(self.time_scale, time_scale)
            and self.warmup_steps == warmup_steps
        )


@dataclass
class RunResult:
    """Everything one :func:`run_profile` measured (bench seconds unless named otherwise)."""

    label: str
    profile: str
    jobs: int
    nodes: int
    replicas: int
    time_scale: float
    steps: int
    seed: int
    sim: dict[str, Any]
    orchestrator_args: list[str]
    busy_fraction: float
    step_seconds_real: float
    switch_seconds_real: float  # configured data movement per switch, real seconds
    wall_seconds: float
    window_seconds: float
    duty: dict[str, float]  # per shared group, over the steady-state window
    analytic_bound: float  # with the configured switch cost
    analytic_bound_measured: float  # with the measured mean switch wall time
    analytic_step_ratio: float
    # The ideal platform (bench.model): zero control plane, the configured switch cost.
    model_duty: float  # same draws as this run (NaN for multi-group profiles)
    model_slowdown: list[float]
    model_long_duty: float  # same profile over MODEL_LONG_STEPS steps: the long-run value
    model_long_slowdown: list[float]
    baseline_step_seconds: list[float]
    shared_step_seconds: list[float]
    slowdown: list[float]  # shared / dedicated mean step time, per job
    steps_per_second: float  # holds completed per bench second, all jobs, in the window
    phases_per_second: float  # accelerator phases completed per bench second, in the window
    switches: int
    switch_wall_ms: Stats
    switch_data_ms: Stats
    switch_control_ms: Stats
    queue_wait_ms: Stats
    orchestrator_metrics: dict[str, float]
    violations: list[str]
    holds: list[HoldRecord]
    switch_spans: list[tuple[float, float]]  # (start, end) from the run's start, agent clock
    baseline: Baseline  # reusable by later runs of the same invocation (``baseline=``)

    @property
    def main_duty(self) -> float:
        """The duty cycle of the first (for most profiles the only) shared group."""
        return next(iter(self.duty.values()))

    @property
    def max_slowdown(self) -> float:
        return max(self.slowdown)

    @property
    def ok(self) -> bool:
        return not self.violations

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["main_duty"] = self.main_duty
        data["max_slowdown"] = self.max_slowdown
        return data


# -- the jobs --------------------------------------------------------------------------------


@dataclass
class _RunLog:
    """What the jobs of one run record (one event loop: no locking needed)."""

    samples: list[PhaseSample] = field(default_factory=list)
    grants: list[GrantSample] = field(default_factory=list)
    recorder: Recorder = field(default_factory=Recorder)


@dataclass(frozen=True)
class _JobSpec:
    index: int
    job_id: str
    groups: dict[str, str]  # role -> group
    client: AsyncTimeSliceClient
    acquire_kwargs: Mapping[str, Any]


async def _hold(
    spec: _JobSpec,
    hold: DrawnHold,
    step: int,
    log: _RunLog,
    time_scale: float,
    acquire_timeout: float,
) -> None:
    group = spec.groups[hold.role]
    client = spec.client
    asked = time.time()
    try:
        scope = client.on_accelerators(group, timeout=acquire_timeout, **spec.acquire_kwargs)
        async with scope as grant:
            granted = time.time()
            log.samples.append(
                PhaseSample(spec.job_id, group, StepPhase.QUEUE, step, asked, granted)
            )
            for drawn in hold.phases:
                begin = time.time()
                await asyncio.sleep(drawn.seconds * time_scale)
                log.samples.append(
                    PhaseSample(spec.job_id, group, drawn.phase, step, begin, time.time())
                )
            released = time.time()
            _record_grant(log, spec.job_id, group, step, asked, granted, released, grant)
    except Exception as exc:
        log.recorder.attempt(Attempt(spec.job_id, group, asked, None, repr(exc)))
        raise


def _record_grant(
    log: _RunLog,
    job: str,
    group: str,
    step: int,
    asked: float,
    granted: float,
    released: float,
    grant: Grant,
) -> None:
    log.recorder.attempt(Attempt(job, group, asked, granted))
    log.recorder.hold(Hold(job, group, grant.epoch, grant.ticket, granted, released))
    log.grants.append(
        GrantSample(
            job=job,
            group=group,
            step=step,
            asked_at=asked,
            granted_at=granted,
            released_at=released,
            epoch=grant.epoch,
            ticket=grant.ticket,
            restored=grant.restored,
            previous_job=grant.previous_job_id or "",
            switch_seconds=grant.switch_seconds,
            waited_seconds=grant.waited_seconds,
        )
    )


async def _sync_job(
    spec: _JobSpec,
    profile: Profile,
    plans: Sequence[StepPlan],
    offset: float,
    log: _RunLog,
    time_scale: float,
    acquire_timeout: float,
) -> None:
    await asyncio.sleep(offset * time_scale)
    for step, plan in enumerate(plans):
        for segment in plan.segments:
            if isinstance(segment, DrawnOff):
                begin = time.time()
                await asyncio.sleep(segment.seconds * time_scale)
                log.samples.append(
                    PhaseSample(spec.job_id, "", segment.phase, step, begin, time.time())
                )
            else:
                await _hold(spec, segment, step, log, time_scale, acquire_timeout)


async def _async_job(
    spec: _JobSpec,
    profile: Profile,
    plans: Sequence[StepPlan],
    batches: Sequence[float],
    log: _RunLog,
    time_scale: float,
    acquire_timeout: float,
) -> None:
    """A shared trainer fed by its own samplers (async RL with a staleness bound)."""
    sampler = profile.sampler
    assert sampler is not None
    produced = 0  # batches ready
    version = 0  # policy versions published (trainer steps done)
    changed = asyncio.Condition()

    async def samplers() -> None:
        nonlocal produced
        for b, seconds in enumerate(batches):
            oldest = b - sampler.staleness

            def fresh_enough(oldest: int = oldest) -> bool:
                return version >= oldest

            async with changed:
                # Off-policy by at most `staleness` versions: wait for the trainer to catch up.
                await changed.wait_for(fresh_enough)
            await asyncio.sleep(seconds * time_scale)
            async with changed:
                produced += 1
                changed.notify_all()

    async def trainer() -> None:
        nonlocal version
        for step, plan in enumerate(plans):
            begin = time.time()

            def batch_ready(step: int = step) -> bool:
                return produced > step

            async with changed:
                await changed.wait_for(batch_ready)
            log.samples.append(
                PhaseSample(spec.job_id, "", StepPhase.BATCH_WAIT, step, begin, time.time())
            )
            for segment in plan.segments:
                assert isinstance(segment, DrawnHold)
                await _hold(spec, segment, step, log, time_scale, acquire_timeout)
            async with changed:
                version += 1
                changed.notify_all()

    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(samplers(), name=f"{spec.job_id}-samplers")
        tasks.create_task(trainer(), name=f"{spec.job_id}-trainer")


async def _run_jobs(
    cluster: LocalCluster,
    profile: Profile,
    job_groups: Sequence[tuple[str, dict[str, str]]],
    draws: Sequence[JobDraws],
    time_scale: float,
    client_kwargs: Mapping[str, Any],
    acquire_kwargs: Callable[[int], Mapping[str, Any]],
    acquire_timeout: float,
    deadline: float,
) -> _RunLog:
    """Run every job to its last step; raise WorkloadError if any failed."""
    log = _RunLog()
    pairs = [(job, group) for job, groups in job_groups for group in groups.values()]
    workers = await register_workers(cluster, pairs)
    clients = [
        AsyncTimeSliceClient(
            rotated(cluster.targets, i), job_id=job, **{**cluster.client_tls, **client_kwargs}
        )
        for i, (job, _) in enumerate(job_groups)
    ]
    try:
        specs = [
            _JobSpec(i, job, groups, clients[i], acquire_kwargs(i))
            for i, (job, groups) in enumerate(job_groups)
        ]
        runs = []
        for spec, d in zip(specs, draws, strict=True):
            if profile.sampler is None:
                runs.append(
                    _sync_job(spec, profile, d.plans, d.offset, log, time_scale, acquire_timeout)
                )
            else:
                runs.append(
                    _async_job(spec, profile, d.plans, d.batches, log, time_scale, acquire_timeout)
                )
        async with asyncio.timeout(deadline):
            results = await asyncio.gather(*runs, return_exceptions=True)
        errors = [
            f"{job}: {r!r}"
            for (job, _), r in zip(job_groups, results, strict=True)
            if isinstance(r, BaseException)
        ]
        if errors:
            raise WorkloadError("benchmark jobs failed: " + "; ".join(errors))
    except TimeoutError:
        raise WorkloadError(f"the jobs did not finish within {deadline:.0f} s") from None
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        await close_workers(workers)
    return log


def _check_history(log: _RunLog, journal: list[JournalEntry]) -> list[str]:
    violations: list[str] = []
    checks: list[tuple[str, Callable[[], object]]] = [
        ("mutual_exclusion", lambda: check_mutual_exclusion(log.recorder.holds)),
        ("fifo", lambda: check_fifo(log.recorder.holds)),
        ("fencing", lambda: check_fencing(journal)),
        ("two_phase", lambda: check_two_phase(journal)),
    ]
    for name, check in checks:
        try:
            check()
        except AssertionError as exc:
            violations.append(f"{name}: {exc}")
    return violations


def _journal(cluster: LocalCluster, groups: set[str]) -> list[JournalEntry]:
    return [
        e
        for path in cluster.agent_journals.values()
        for e in read_journal(path)
        if e.group in groups
    ]


# -- runs ------------------------------------------------------------------------------------


def _cluster_kwargs(
    nodes: int, sim: SimCosts, time_scale: float, cluster_kwargs: Mapping[str, Any] | None
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"replicas": 1, "agents": nodes, "backend": "sim"}
    extra = dict(cluster_kwargs or {})
    # Our sim flags first: a caller's agent_args come later and so win in argparse.
    agent_args = [*sim.agent_args(time_scale), *extra.pop("agent_args", ())]
    kwargs.update(extra)
    kwargs["agent_args"] = agent_args
    return kwargs


def _deadline(profile: Profile, jobs: int, steps: int, time_scale: float, sim: SimCosts) -> float:
    # Generous: a saturated group stretches every step to a whole round of holds + switches.
    step = (profile.step_seconds + sim.switch_seconds) * time_scale
    return 60.0 + 4.0 * (steps + 1) * step * max(1, jobs)


def _acquire_timeout(profile: Profile, jobs: int, time_scale: float, sim: SimCosts) -> float:
    round_seconds = jobs * (profile.accelerator_seconds + sim.switch_seconds) * time_scale
    return max(_MIN_ACQUIRE_TIMEOUT, 10.0 * round_seconds)


def _acquire_kwargs_fn(
    acquire_kwargs: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None,
) -> Callable[[int], Mapping[str, Any]]:
    if acquire_kwargs is None:
        return lambda _: {}
    if callable(acquire_kwargs):
        return acquire_kwargs
    fixed = dict(acquire_kwargs)
    return lambda _: fixed


async def _baseline_in(
    cluster: LocalCluster,
    profile: Profile,
    jobs: int,
    steps: int,
    seed: int,
    time_scale: float,
    warmup_steps: int,
    sim: SimCosts,
    client_kwargs: Mapping[str, Any],
    acquire_kwargs: Callable[[int], Mapping[str, Any]],
) -> Baseline:
    job_groups = [
        (f"{profile.name}-{i}-ded", {r: f"{profile.name}-{r}-ded{i}" for r in profile.roles})
        for i in range(jobs)
    ]
    draws = [draw_job(profile, i, steps, seed) for i in range(jobs)]
    log = await _run_jobs(
        cluster,
        profile,
        job_groups,
        draws,
        time_scale,
        client_kwargs,
        acquire_kwargs,
        _acquire_timeout(profile, 1, time_scale, sim),
        _deadline(profile, 1, steps, time_scale, sim),
    )
    groups = {g for _, gs in job_groups for g in gs.values()}
    violations = _check_history(log, _journal(cluster, groups))
    step_seconds = [mean_step_seconds(log.samples, job, warmup_steps) for job, _ in job_groups]
    duty: list[float] = []
    for job, gs in job_groups:
        window = active_window(log.samples, [job], warmup_steps)
        own = [s for s in log.samples if s.job == job]
        duty.append(duty_by_group(own, window).get(next(iter(gs.values())), 0.0))
    return Baseline(
        profile.name, jobs, steps, seed, time_scale, warmup_steps, step_seconds, duty, violations
    )


async def measure_baseline(
    profile: Profile,
    jobs: int,
    *,
    time_scale: float,
    steps: int,
    sim: SimCosts = DEFAULT_COSTS,
    nodes: int = 2,
    seed: int = 1,
    warmup_steps: int = 1,
    cluster_kwargs: Mapping[str, Any] | None = None,
    client_kwargs: Mapping[str, Any] | None = None,
    acquire_kwargs: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None = None,
) -> Baseline:
    """Measure only the dedicated baseline of ``jobs`` jobs (reusable by later runs)."""
    kwargs = _cluster_kwargs(nodes, sim, time_scale, cluster_kwargs)
    async with running_cluster(**kwargs) as cluster:
        return await _baseline_in(
            cluster,
            profile,
            jobs,
            steps,
            seed,
            time_scale,
            warmup_steps,
            sim,
            client_kwargs or {},
            _acquire_kwargs_fn(acquire_kwargs),
        )


async def arun_profile(
    profile: Profile,
    jobs: int,
    *,
    time_scale: float,
    steps: int,
    cluster_kwargs: Mapping[str, Any] | None = None,
    sim: SimCosts = DEFAULT_COSTS,
    nodes: int = 2,
    seed: int = 1,
    warmup_steps: int = 1,
    baseline: Baseline | None = None,
    client_kwargs: Mapping[str, Any] | None = None,
    acquire_kwargs: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None = None,
    label: str | None = None,
) -> RunResult:
    """The asyncio form of :func:`run_profile` (same arguments)."""
    if jobs < 1:
        raise ValueError("jobs must be at least 1")
    if steps < warmup_steps + 2:
        raise ValueError(f"steps must be at least warmup_steps + 2 ({warmup_steps + 2})")
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    if baseline is not None and not baseline.covers(
        profile, jobs, steps, seed, time_scale, warmup_steps
    ):
        raise ValueError(
            f"baseline {baseline.profile}/{baseline.jobs} jobs does not cover "
            "this run (profile, jobs, steps, seed, time scale, warm-up)"
        )
    label = label or f"{profile.name}-n{jobs}"
    kwargs = _cluster_kwargs(nodes, sim, time_scale, cluster_kwargs)
    client_kw = dict(client_kwargs or {})
    acquire_fn = _acquire_kwargs_fn(acquire_kwargs)
    started = time.monotonic()
    async with running_cluster(**kwargs) as cluster:
        if baseline is None:
            baseline = await _baseline_in(
                cluster,
                profile,
                jobs,
                steps,
                seed,
                time_scale,
                warmup_steps,
                sim,
                client_kw,
                acquire_fn,
            )
        job_groups = [
            (f"{profile.name}-{i}", {r: f"{profile.name}-{r}" for r in profile.roles})
            for i in range(jobs)
        ]
        draws = [draw_job(profile, i, steps, seed) for i in range(jobs)]
        log = await _run_jobs(
            cluster,
            profile,
            job_groups,
            draws,
            time_scale,
            client_kw,
            acquire_fn,
            _acquire_timeout(profile, jobs, time_scale, sim),
            _deadline(profile, jobs, steps, time_scale, sim),
        )
        groups = {f"{profile.name}-{r}" for r in profile.roles}
        journal = _journal(cluster, groups)
        metrics = await scrape_metrics(cluster.replica_http)
        replicas = len(cluster.replica_ids)
    return _result(
        label,
        profile,
        jobs,
        nodes,
        replicas,
        time_scale,
        steps,
        seed,
        warmup_steps,
        sim,
        list(kwargs.get("orchestrator_args", [])),
        baseline,
        log,
        journal,
        metrics,
        [job for job, _ in job_groups],
        time.monotonic() - started,
    )


def run_profile(
    profile: Profile,
    jobs: int,
    *,
    time_scale: float,
    steps: int,
    cluster_kwargs: Mapping[str, Any] | None = None,
    sim: SimCosts = DEFAULT_COSTS,
    nodes: int = 2,
    seed: int = 1,
    warmup_steps: int = 1,
    baseline: Baseline | None = None,
    client_kwargs: Mapping[str, Any] | None = None,
    acquire_kwargs: Mapping[str, Any] | Callable[[int], Mapping[str, Any]] | None = None,
    label: str | None = None,
) -> RunResult:
    """Run ``jobs`` copies of ``profile`` dedicated, then shared, on a fresh LocalCluster.

    Args:
        profile: what each job does (:data:`bench.profiles.PROFILES`).
        jobs: how many jobs share the group (each also gets a dedicated group for the baseline).
        time_scale: bench seconds per real second, for phases and modelled transfers alike.
        steps: steps per job and run (the first ``warmup_steps`` are left out of step times
            and of the duty-cycle window).
        cluster_kwargs: extra :class:`LocalCluster` arguments (``replicas``,
            ``orchestrator_args``, ``agent_args`` appended after the sim flags, ...).
        sim: the agents' device-state and bandwidth model.
        nodes: agents (nodes) in the group; every job has a worker on every node.
        seed: the random draws (the same for the dedicated and the shared run).
        baseline: a dedicated baseline measured earlier in this invocation for at least these
            jobs with the same settings; ``None`` measures one first, in the same cluster.
        client_kwargs: extra :class:`AsyncTimeSliceClient` arguments (``session_ttl``, ...).
        acquire_kwargs: extra ``on_accelerators`` arguments (``priority``...), fixed or per
            job index.
        label: the run's name in reports (default ``<profile>-n<jobs>``).

    Raises:
        WorkloadError: a job failed or the run did not finish in time.
        ClusterError: the cluster did not start.
    """
    return asyncio.run(
        arun_profile(
            profile,
            jobs,
            time_scale=time_scale,
            steps=steps,
            cluster_kwargs=cluster_kwargs,
            sim=sim,
            nodes=nodes,
            seed=seed,
            warmup_steps=warmup_steps,
            baseline=baseline,
            client_kwargs=client_kwargs,
            acquire_kwargs=acquire_kwargs,
            label=label,
        )
    )


def _models(
    profile: Profile, jobs: int, sim: SimCosts, steps: int, seed: int, warmup_steps: int
) -> tuple[ModelOutcome, ModelOutcome]:
    """The ideal platform on this run's draws, and over many steps (NaN if not modelled)."""
    if len(profile.roles) != 1:
        nan = float("nan")
        none = ModelOutcome(nan, [nan] * jobs, 0)
        return none, none
    same = simulate(
        profile,
        jobs,
        switch_seconds=sim.switch_seconds,
        steps=steps,
        seed=seed,
        warmup_steps=warmup_steps,
    )
    long = simulate(
        profile,
        jobs,
        switch_seconds=sim.switch_seconds,
        steps=MODEL_LONG_STEPS,
        seed=seed,
        warmup_steps=warmup_steps,
    )
    return same, long


def _result(
    label: str,
    profile: Profile,
    jobs: int,
    nodes: int,
    replicas: int,
    time_scale: float,
    steps: int,
    seed: int,
    warmup_steps: int,
    sim: SimCosts,
    orchestrator_args: list[str],
    baseline: Baseline,
    log: _RunLog,
    journal: list[JournalEntry],
    metrics: dict[str, float],
    job_ids: list[str],
    wall: float,
) -> RunResult:
    window = active_window(log.samples, job_ids, warmup_steps)
    shared_groups = sorted({g.group for g in log.grants})
    duty = duty_by_group([s for s in log.samples if s.group in shared_groups], window)
    shared_steps = [mean_step_seconds(log.samples, job, warmup_steps) for job in job_ids]
    slowdown = [
        shared / alone
        for shared, alone in zip(shared_steps, baseline.step_seconds[:jobs], strict=True)
    ]
    splits = split_switches(log.grants, journal)
    switch_grants = [g for g in log.grants if g.is_switch]
    in_window = [
        s for s in log.samples if s.phase.on_accelerator and window.start <= s.end <= window.end
    ]
    holds_in_window = [g for g in log.grants if window.start <= g.released_at <= window.end]
    # The measured switch cost relative to the step of a job alone, both in bench seconds.
    alone_step = math.fsum(baseline.step_seconds[:jobs]) / jobs
    mean_wall = math.fsum(g.switch_seconds for g in switch_grants) / max(1, len(switch_grants))
    t0 = min(s.start for s in log.samples)
    violations = list(baseline.violations) + _check_history(log, journal)
    same, long = _models(profile, jobs, sim, steps, seed, warmup_steps)
    return RunResult(
        label=label,
        profile=profile.name,
        jobs=jobs,
        nodes=nodes,
        replicas=replicas,
        time_scale=time_scale,
        steps=steps,
        seed=seed,
        sim={**asdict(sim), "switch_seconds": sim.switch_seconds, "note": SIM_LABEL},
        orchestrator_args=orchestrator_args,
        busy_fraction=profile.busy_fraction,
        step_seconds_real=profile.step_seconds,
        switch_seconds_real=sim.switch_seconds,
        wall_seconds=wall,
        window_seconds=window.duration,
        duty=duty,
        analytic_bound=analytic_duty_bound(
            jobs, profile.busy_fraction, sim.switch_seconds / profile.step_seconds
        ),
        analytic_bound_measured=analytic_duty_bound(
            jobs, profile.busy_fraction, mean_wall / alone_step if switch_grants else 0.0
        ),
        analytic_step_ratio=analytic_step_ratio(
            jobs, profile.busy_fraction, sim.switch_seconds / profile.step_seconds
        ),
        model_duty=same.duty,
        model_slowdown=same.slowdown,
        model_long_duty=long.duty,
        model_long_slowdown=long.slowdown,
        baseline_step_seconds=list(baseline.step_seconds[:jobs]),
        shared_step_seconds=shared_steps,
        slowdown=slowdown,
        steps_per_second=len(holds_in_window) / window.duration,
        phases_per_second=len(in_window) / window.duration,
        switches=len(switch_grants),
        switch_wall_ms=Stats.of(g.switch_seconds for g in switch_grants).scaled(1000),
        switch_data_ms=Stats.of(s.data for s in splits).scaled(1000),
        switch_control_ms=Stats.of(s.control for s in splits).scaled(1000),
        queue_wait_ms=Stats.of(g.wait for g in log.grants).scaled(1000),
        orchestrator_metrics={
            k: v
            for k, v in metrics.items()
            if k.startswith(("timeslice_switches_total", "timeslice_grants_total"))
        },
        violations=violations,
        holds=[
            HoldRecord(g.job, g.group, g.granted_at - t0, g.released_at - t0)
            for g in sorted(log.grants, key=lambda g: g.granted_at)
        ],
        switch_spans=[(s.start - t0, s.end - t0) for s in splits],
        baseline=baseline,
    )
