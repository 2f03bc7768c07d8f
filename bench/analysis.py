"""Pure maths of the benchmarks: windows, duty cycles, slowdowns, switch splits, bounds.

Everything here is a function of recorded samples (no I/O, no clocks), unit-tested on known
inputs (tests/bench). Interval and duty-cycle arithmetic is :mod:`timeslice_tools.dev.timeline`'s;
percentiles are :func:`timeslice_tools.history.percentile` (nearest rank), so the benchmarks and the
invariant checks agree on what p99 means.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.profiles import StepPhase
from timeslice_agent.journal import JournalEntry
from timeslice_tools.dev.timeline import Interval, duty_cycle
from timeslice_tools.history import percentile

__all__ = [
    "GrantSample",
    "PhaseSample",
    "Stats",
    "SwitchSplit",
    "active_window",
    "analytic_duty_bound",
    "analytic_step_ratio",
    "duty_by_group",
    "mean_step_seconds",
    "split_switches",
    "step_spans",
]


@dataclass(frozen=True, slots=True)
class PhaseSample:
    """One phase of one step of one job, in wall-clock seconds (``time.time()``)."""

    job: str
    group: str  # the group acquired for accelerator and queue phases; "" off the accelerators
    phase: StepPhase
    step: int
    start: float
    end: float

    @property
    def interval(self) -> Interval:
        return Interval(self.start, self.end)


@dataclass(frozen=True, slots=True)
class GrantSample:
    """One acquire of one step: when it was asked, granted and given back, and the Grant."""

    job: str
    group: str
    step: int
    asked_at: float
    granted_at: float
    released_at: float
    epoch: int
    ticket: int
    restored: bool
    previous_job: str
    switch_seconds: float
    waited_seconds: float

    @property
    def wait(self) -> float:
        """Client-side wait: from calling acquire until the grant arrived."""
        return self.granted_at - self.asked_at

    @property
    def is_switch(self) -> bool:
        """The grant moved another job's state off the devices (a context switch)."""
        return self.restored and self.previous_job not in ("", self.job)


@dataclass(frozen=True, slots=True)
class Stats:
    """Summary of a sample: count, p50, p99 (nearest rank), mean and max; NaN when empty."""

    n: int
    p50: float
    p99: float
    mean: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Stats:
        items = sorted(values)
        if not items:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan)
        return cls(
            n=len(items),
            p50=percentile(items, 0.5),
            p99=percentile(items, 0.99),
            mean=math.fsum(items) / len(items),
            max=items[-1],
        )

    def scaled(self, factor: float) -> Stats:
        """The same summary in other units (seconds to milliseconds: 1000)."""
        return Stats(
            self.n, self.p50 * factor, self.p99 * factor, self.mean * factor, self.max * factor
        )


@dataclass(frozen=True, slots=True)
class SwitchSplit:
    """One context switch: its wall time split into data movement and control plane.

    ``data`` is the slowest node's checkpoint plus the slowest node's restore (the two phases
    run one after the other, each across all nodes at once), from the agents' journals;
    ``control`` is the rest of the switch wall time the orchestrator reported
    (``Grant.switch_seconds``): etcd writes, directive fan-out and acks, the commit.
    """

    group: str
    epoch: int  # the grant's epoch
    switch_epoch: int  # the switch record's epoch (what the directives carried)
    from_job: str
    to_job: str
    start: float  # first checkpoint started (agent clock); the restore's start when none
    end: float  # last restore finished (agent clock)
    wall: float
    data: float

    @property
    def control(self) -> float:
        return self.wall - self.data


def step_spans(samples: Iterable[PhaseSample], job: str) -> dict[int, Interval]:
    """Each step of ``job``: from its first phase's start to its last phase's end."""
    spans: dict[int, Interval] = {}
    for s in samples:
        if s.job != job:
            continue
        seen = spans.get(s.step)
        spans[s.step] = (
            s.interval if seen is None else Interval(min(seen.start, s.start), max(seen.end, s.end))
        )
    return dict(sorted(spans.items()))


def mean_step_seconds(samples: Iterable[PhaseSample], job: str, warmup: int = 1) -> float:
    """Mean wall time of ``job``'s steps, leaving out the first ``warmup`` steps."""
    spans = [span for step, span in step_spans(samples, job).items() if step >= warmup]
    if not spans:
        raise ValueError(f"job {job} has no step after the first {warmup}")
    return math.fsum(s.duration for s in spans) / len(spans)


def active_window(samples: Sequence[PhaseSample], jobs: Sequence[str], warmup: int = 1) -> Interval:
    """When every job is in its steady state: the latest start of step ``warmup`` to the
    earliest end of a job's last step.

    Before it some jobs have not started (or are still in their first, cold step); after it
    some have finished, and the others run with less competition than in steady state.
    Raises ValueError when the jobs never ran together (the window would be empty).
    """
    starts: list[float] = []
    ends: list[float] = []
    for job in jobs:
        spans = step_spans(samples, job)
        later = [span for step, span in spans.items() if step >= warmup]
        if not later:
            raise ValueError(f"job {job} has no step after the first {warmup}")
        starts.append(later[0].start)
        ends.append(later[-1].end)
    window = (max(starts), min(ends))
    if window[1] <= window[0]:
        raise ValueError(
            f"the jobs never ran together after warm-up (window {window[0]:.3f}..{window[1]:.3f})"
        )
    return Interval(*window)


def duty_by_group(samples: Iterable[PhaseSample], window: Interval) -> dict[str, float]:
    """Per group: the fraction of ``window`` some job is inside an accelerator phase on it."""
    by_group: dict[str, list[Interval]] = defaultdict(list)
    for s in samples:
        if s.phase.on_accelerator:
            by_group[s.group].append(s.interval)
    return {g: duty_cycle(items, window) for g, items in sorted(by_group.items())}


def split_switches(
    grants: Iterable[GrantSample], journal: Iterable[JournalEntry]
) -> list[SwitchSplit]:
    """Match every context-switch grant with its directives in the agents' journals.

    Directives carry the switch record's epoch, which is older than the grant's epoch; a
    grant's switch is the newest switch of its group, older than the grant, that restored the
    granted job. Rolled-back attempts (restores of the evicted job) never match a grant.
    """
    by_switch: dict[tuple[str, int], list[JournalEntry]] = defaultdict(list)
    for e in journal:
        if e.status == "ok":
            by_switch[(e.group, e.epoch)].append(e)
    restores: dict[tuple[str, str], list[int]] = defaultdict(list)
    for (group, epoch), entries in by_switch.items():
        for job in {e.job for e in entries if e.kind == "restore"}:
            restores[(group, job)].append(epoch)
    for epochs in restores.values():
        epochs.sort()
    out: list[SwitchSplit] = []
    for g in sorted(grants, key=lambda g: (g.group, g.epoch)):
        if not g.is_switch:
            continue
        candidates = [e for e in restores.get((g.group, g.job), []) if e < g.epoch]
        if not candidates:
            continue
        epoch = candidates[-1]
        entries = by_switch[(g.group, epoch)]
        checkpoints = [e for e in entries if e.kind == "checkpoint"]
        restored = [e for e in entries if e.kind == "restore" and e.job == g.job]
        data = max((e.finished_at - e.started_at for e in checkpoints), default=0.0) + max(
            (e.finished_at - e.started_at for e in restored), default=0.0
        )
        first = checkpoints or restored
        out.append(
            SwitchSplit(
                group=g.group,
                epoch=g.epoch,
                switch_epoch=epoch,
                from_job=g.previous_job,
                to_job=g.job,
                start=min(e.started_at for e in first),
                end=max(e.finished_at for e in restored),
                wall=g.switch_seconds,
                data=data,
            )
        )
    return out


def analytic_duty_bound(jobs: int, busy: float, switch_fraction: float) -> float:
    """Upper bound on the duty cycle of ``jobs`` identical jobs sharing one group.

    Each job alone is busy ``busy`` of its step ``T``; every hold of a shared group is
    preceded by a context switch of ``s = switch_fraction * T`` (lazy switching: the switch
    starts when the next job asks). With ``f = busy`` and ``sigma = s / T``:

    * one job: nothing ever switches, the duty is ``f``;
    * unsaturated (the group has slack): each step takes ``T + s``, the duty is
      ``N f / (1 + sigma)``;
    * saturated (the group is always computing or switching): the duty is ``f / (f + sigma)``.

    So ``bound = min(N f, f (1 + sigma) / (f + sigma)) / (1 + sigma)``, which is
    ``min(1, N f)`` with free switches.
    """
    if jobs < 1:
        raise ValueError("jobs must be at least 1")
    if not 0 < busy <= 1:
        raise ValueError("busy must be within (0, 1]")
    if switch_fraction < 0:
        raise ValueError("switch_fraction must be >= 0")
    if jobs == 1:
        return busy
    sigma = switch_fraction
    return min(jobs * busy, busy * (1 + sigma) / (busy + sigma)) / (1 + sigma)


def analytic_step_ratio(jobs: int, busy: float, switch_fraction: float) -> float:
    """The least step-time slowdown (shared / alone) of the same model as the bound.

    Unsaturated, each step pays its own switch: ``1 + sigma``; saturated, a step lasts a
    whole round of ``N`` holds and switches: ``N (f + sigma)``.
    """
    if jobs < 1:
        raise ValueError("jobs must be at least 1")
    if jobs == 1:
        return 1.0
    return max(1.0 + switch_fraction, jobs * (busy + switch_fraction))
