"""The ideal platform: the same jobs and draws, simulated with a zero-overhead scheduler.

A discrete-event simulation of one exclusive group under FIFO with lazy switching: a job asks
when its off-accelerator time ends; the group serves the earliest request once it is free;
serving a job other than the resident one first costs the switch (checkpoint + restore),
nothing else costs anything. It uses the run's own random draws (:func:`draw_job`), start
offsets and metrics code (:mod:`bench.analysis`), so for every run it tells apart:

* analytic bound - model: what the jobs' variability costs (collisions: a job that finds the
  group busy waits, and its next step starts later), with a perfect control plane;
* model - measured: what the real platform adds (control plane, agents, timer noise).

Times are real seconds; no time scale is involved. Single-role profiles only (one group).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from bench.analysis import PhaseSample, active_window, duty_by_group, mean_step_seconds
from bench.profiles import DrawnHold, DrawnOff, JobDraws, Profile, StepPhase, draw_job

__all__ = ["ModelOutcome", "simulate"]

_GROUP = "model"


@dataclass(frozen=True)
class ModelOutcome:
    """What the ideal platform achieves with these jobs and this switch cost."""

    duty: float
    slowdown: list[float]  # per job: shared / alone mean step time
    switches: int


@dataclass
class _Job:
    index: int
    draws: JobDraws
    step: int = 0
    segment: int = 0
    clock: float = 0.0  # when the job's next request is (or its last activity ended)
    versions: list[float] | None = None  # async: when each policy version was published
    ready: list[float] | None = None  # async: when each batch was ready


def _advance(job: _Job, samples: list[PhaseSample], name: str) -> bool:
    """Walk ``job`` through off-accelerator segments up to its next hold; False when done."""
    while job.step < len(job.draws.plans):
        segments = job.draws.plans[job.step].segments
        if job.segment >= len(segments):
            job.step += 1
            job.segment = 0
            continue
        segment = segments[job.segment]
        if isinstance(segment, DrawnOff):
            end = job.clock + segment.seconds
            samples.append(PhaseSample(name, "", segment.phase, job.step, job.clock, end))
            job.clock = end
            job.segment += 1
            continue
        return True
    return False


def _batch_ready(job: _Job, profile: Profile, step: int) -> float:
    """When batch ``step`` is ready: samplers run ahead of the trainer by at most k versions."""
    assert profile.sampler is not None and job.ready is not None and job.versions is not None
    k = profile.sampler.staleness
    while len(job.ready) <= step:
        b = len(job.ready)
        previous = job.ready[-1] if job.ready else 0.0
        needed = b - k  # the version this batch may be generated from at the oldest
        published = 0.0 if needed <= 0 else job.versions[needed - 1]
        job.ready.append(max(previous, published) + job.draws.batches[b])
    return job.ready[step]


def _schedule(
    profile: Profile, draws: list[JobDraws], switch_seconds: float, shared: bool
) -> tuple[list[PhaseSample], int]:
    samples: list[PhaseSample] = []
    jobs = [_Job(i, d) for i, d in enumerate(draws)]
    requests: list[tuple[float, int]] = []
    for job in jobs:
        if profile.sampler is None:
            job.clock = job.draws.offset
            if _advance(job, samples, f"j{job.index}"):
                heapq.heappush(requests, (job.clock, job.index))
        else:
            job.versions, job.ready = [], []
            job.clock = _batch_ready(job, profile, 0)
            samples.append(
                PhaseSample(f"j{job.index}", "", StepPhase.BATCH_WAIT, 0, 0.0, job.clock)
            )
            heapq.heappush(requests, (job.clock, job.index))
    free_at = [0.0] * len(jobs)  # per group: one shared group, or one per job
    resident: list[int | None] = [None] * len(jobs)
    switches = 0
    while requests:
        asked, index = heapq.heappop(requests)
        job = jobs[index]
        name = f"j{index}"
        group = 0 if shared else index
        start = max(asked, free_at[group])
        if resident[group] is not None and resident[group] != index:
            start += switch_seconds
            switches += 1
        resident[group] = index
        samples.append(PhaseSample(name, _GROUP, StepPhase.QUEUE, job.step, asked, start))
        hold = job.draws.plans[job.step].segments[job.segment]
        assert isinstance(hold, DrawnHold)
        for drawn in hold.phases:
            samples.append(
                PhaseSample(name, _GROUP, drawn.phase, job.step, start, start + drawn.seconds)
            )
            start += drawn.seconds
        free_at[group] = job.clock = start
        job.segment += 1
        if profile.sampler is None:
            if _advance(job, samples, name):
                heapq.heappush(requests, (job.clock, index))
            continue
        assert job.versions is not None
        job.versions.append(start)
        job.step += 1
        job.segment = 0
        if job.step < len(job.draws.plans):
            ready = max(start, _batch_ready(job, profile, job.step))
            samples.append(PhaseSample(name, "", StepPhase.BATCH_WAIT, job.step, start, ready))
            job.clock = ready
            heapq.heappush(requests, (ready, index))
    return samples, switches


def simulate(
    profile: Profile,
    jobs: int,
    *,
    switch_seconds: float,
    steps: int,
    seed: int = 1,
    warmup_steps: int = 1,
) -> ModelOutcome:
    """Duty cycle and slowdowns of ``jobs`` jobs on an ideal platform (see the module doc).

    Uses the draws of :func:`~bench.profiles.draw_job` with the same ``seed`` as a
    benchmark run, so the two are comparable job for job.
    """
    if len(profile.roles) != 1:
        raise ValueError(f"profile {profile.name}: the model simulates one group only")
    if switch_seconds < 0:
        raise ValueError("switch_seconds must be >= 0")
    draws = [draw_job(profile, i, steps, seed) for i in range(jobs)]
    alone, _ = _schedule(profile, draws, switch_seconds, shared=False)
    together, switches = _schedule(profile, draws, switch_seconds, shared=True)
    names = [f"j{i}" for i in range(jobs)]
    window = active_window(together, names, warmup_steps)
    duty = duty_by_group(together, window).get(_GROUP, 0.0)
    slowdown = [
        mean_step_seconds(together, n, warmup_steps) / mean_step_seconds(alone, n, warmup_steps)
        for n in names
    ]
    assert all(math.isfinite(x) for x in slowdown)
    return ModelOutcome(duty, slowdown, switches)
