"""Automatic placement (:mod:`timeslice.placement`) against its alternatives, on the same draws.

    python -m bench.placement                          # the documented run
    python -m bench.placement --draws 3 --jobs 6 --steps 20 --json /tmp/p.json   # a quick look

Emulation: every number is the simulated timeline of the workload generator's jobs, not a run
of real processes. Each draw makes ``N`` jobs (6 to 12) of mixed profiles: sync GRPO steps or
async trainers fed by dedicated samplers (staleness 1), busy 20% to 60% (or all 40%: the "40%
mix"), periods of 60, 100 or 150 s, phase-to-phase variation (gamma jitter, cv 0.05 to 0.25),
a switch cost of 1.6 or 4 s. Their durations are drawn with :func:`bench.profiles.draw_job`
and scheduled by a discrete-event model of exclusive FIFO groups with lazy switching (the one of
:mod:`bench.model`, generalised to jobs of different profiles and switch costs): a job asks
when its off-accelerator time ends, a group serves the earliest request once free, serving a
job other than the resident one first costs that job's switch. Every job runs about the same
wall time (``steps`` x 100 s), the first step is warm-up.

Per draw, the same jobs under each plan of a pool of ``K = ceil(0.75 N)`` groups:

* **dedicated**: one group per job (needs N groups: the baseline);
* **random**: jobs shuffled and paired, whatever their load;
* **ours, on arrival**: jobs arrive one by one with their *declared* profile (busy and period,
  no phase, cv 0.1); each is placed with the earlier ones running (never moved);
* **ours**: at their restart point, every job is re-placed from its *measured* profile (the
  holds of its dedicated run: busy, period, cv, phase);
* **exhaustive (model)**: :func:`timeslice.placement.place_exhaustive` on the measured profiles;
* **optimum**: the best plan by *simulated* duty among every partition into at most K groups
  that keeps each shared group under the cap (N <= ``--exhaustive-max``): an oracle.

Reported per plan: aggregate duty (accelerator busy time over the groups in use, the mean of
their duty cycles in the window where all their jobs run) and the worst job's slowdown
(shared / alone mean step time). Targets (issue 40): ours >= 0.95 x the optimum's duty with a
worst slowdown at most 5 points above it; ours >= 1.5 x dedicated on the 40% mix.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench._common import machine_info, machine_line
from bench.analysis import PhaseSample, active_window, duty_by_group, mean_step_seconds
from bench.profiles import (
    AsyncSampler,
    DrawnHold,
    DrawnOff,
    Hold,
    Jitter,
    JobDraws,
    PhaseSpec,
    Profile,
    StepPhase,
    draw_job,
    sync_profile,
)
from timeslice.placement import (
    Constraints,
    Demand,
    JobProfile,
    JobState,
    Mode,
    Placement,
    Slot,
    Source,
    nominal_load,
    place,
    place_exhaustive,
)

__all__ = ["BenchJob", "DrawResult", "PlanResult", "make_jobs", "run_draw", "simulate_group"]

LABEL = "emulation (simulated timeline of the workload generator's draws)"
_DURATION_STEPS_OF_100S = 60
_PERIODS = (60.0, 100.0, 150.0)
_CVS = (0.05, 0.1, 0.25)
_SWITCHES = (1.6, 4.0)
_WARMUP = 1


@dataclass(frozen=True)
class BenchJob:
    """One job of a draw: its bench profile, drawn durations and placement profiles."""

    name: str
    profile: Profile
    draws: JobDraws
    mode: Mode
    busy: float
    period: float
    cv: float
    switch_seconds: float

    def declared(self) -> JobProfile:
        """What the job says before it is measured: busy and period, default variation."""
        return JobProfile(
            busy=self.busy,
            period_seconds=self.period,
            mode=self.mode,
            switch_seconds=self.switch_seconds,
            source=Source.DECLARED,
        )


def _bench_profile(name: str, mode: Mode, busy: float, period: float, cv: float) -> Profile:
    jitter = Jitter(cv)
    if mode is Mode.SYNC:
        return sync_profile(
            name,
            f"sync, busy {busy:.0%}, period {period:g} s, cv {cv:g}",
            {StepPhase.ROLLOUT: 0.6, StepPhase.TRAIN: 0.4},
            busy,
            step_seconds=period,
            spreads={StepPhase.ROLLOUT: jitter, StepPhase.TRAIN: jitter, StepPhase.REWARD: jitter},
        )
    return Profile(
        name,
        f"async trainer, busy {busy:.0%}, period {period:g} s, cv {cv:g}",
        (Hold((PhaseSpec(StepPhase.TRAIN, busy * period, jitter),)),),
        sampler=AsyncSampler(batch_seconds=period, staleness=1, spread=jitter),
    )


def make_jobs(n: int, seed: int, draw: int, *, busy40: bool, steps: int) -> list[BenchJob]:
    """The ``n`` jobs of one draw, in arrival order (the same for every plan)."""
    rng = random.Random(f"placement:{seed}:{draw}:{n}:{busy40}")
    jobs = []
    for i in range(n):
        mode = Mode.SYNC if rng.random() < 0.6 else Mode.ASYNC
        busy = 0.4 if busy40 else round(rng.uniform(0.2, 0.6), 3)
        period = rng.choice(_PERIODS)
        cv = rng.choice(_CVS)
        switch = rng.choice(_SWITCHES)
        name = f"d{draw}-j{i}-{mode.value}-{busy:.2f}-{period:g}"
        profile = _bench_profile(name, mode, busy, period, cv)
        job_steps = max(_WARMUP + 3, round(steps * 100.0 / period))
        jobs.append(
            BenchJob(
                name, profile, draw_job(profile, i, job_steps, seed), mode, busy, period, cv, switch
            )
        )
    return jobs


# ---------------------------------------------------------------------------------------------
# The simulated timeline


@dataclass
class _Run:
    job: BenchJob
    step: int = 0
    segment: int = 0
    clock: float = 0.0
    versions: list[float] = field(default_factory=list)
    ready: list[float] = field(default_factory=list)


def _advance(run: _Run, samples: list[PhaseSample]) -> bool:
    plans = run.job.draws.plans
    while run.step < len(plans):
        segments = plans[run.step].segments
        if run.segment >= len(segments):
            run.step += 1
            run.segment = 0
            continue
        segment = segments[run.segment]
        if isinstance(segment, DrawnOff):
            end = run.clock + segment.seconds
            samples.append(PhaseSample(run.job.name, "", segment.phase, run.step, run.clock, end))
            run.clock = end
            run.segment += 1
            continue
        return True
    return False


def _batch_ready(run: _Run, step: int) -> float:
    sampler = run.job.profile.sampler
    assert sampler is not None
    while len(run.ready) <= step:
        b = len(run.ready)
        previous = run.ready[-1] if run.ready else 0.0
        needed = b - sampler.staleness
        published = 0.0 if needed <= 0 else run.versions[needed - 1]
        run.ready.append(max(previous, published) + run.job.draws.batches[b])
    return run.ready[step]


def simulate_group(jobs: Sequence[BenchJob], group: str = "g") -> list[PhaseSample]:
    """The timeline of ``jobs`` sharing one exclusive FIFO group (lazy switching)."""
    samples: list[PhaseSample] = []
    runs = [_Run(j) for j in jobs]
    requests: list[tuple[float, int]] = []
    for index, run in enumerate(runs):
        if run.job.profile.sampler is None:
            run.clock = run.job.draws.offset
            if _advance(run, samples):
                heapq.heappush(requests, (run.clock, index))
        else:
            start = run.job.draws.offset
            run.clock = start + _batch_ready(run, 0)
            run.ready = [r + start for r in run.ready]
            samples.append(PhaseSample(run.job.name, "", StepPhase.BATCH_WAIT, 0, start, run.clock))
            heapq.heappush(requests, (run.clock, index))
    free_at = 0.0
    resident: int | None = None
    while requests:
        asked, index = heapq.heappop(requests)
        run = runs[index]
        start = max(asked, free_at)
        if resident is not None and resident != index:
            start += run.job.switch_seconds
        resident = index
        name = run.job.name
        samples.append(PhaseSample(name, group, StepPhase.QUEUE, run.step, asked, start))
        hold = run.job.draws.plans[run.step].segments[run.segment]
        assert isinstance(hold, DrawnHold)
        for drawn in hold.phases:
            samples.append(
                PhaseSample(name, group, drawn.phase, run.step, start, start + drawn.seconds)
            )
            start += drawn.seconds
        free_at = run.clock = start
        run.segment += 1
        if run.job.profile.sampler is None:
            if _advance(run, samples):
                heapq.heappush(requests, (run.clock, index))
            continue
        run.versions.append(start)
        run.step += 1
        run.segment = 0
        if run.step < len(run.job.draws.plans):
            ready = max(start, _batch_ready(run, run.step))
            samples.append(PhaseSample(name, "", StepPhase.BATCH_WAIT, run.step, start, ready))
            run.clock = ready
            heapq.heappush(requests, (ready, index))
    return samples


@dataclass(frozen=True)
class _GroupOutcome:
    duty: float
    step_seconds: dict[str, float]


class _Timeline:
    """Simulated outcomes of groups of one draw's jobs, each simulated once."""

    def __init__(self, jobs: Sequence[BenchJob]) -> None:
        self.jobs = list(jobs)
        self.cache: dict[frozenset[int], _GroupOutcome] = {}

    def group(self, members: frozenset[int]) -> _GroupOutcome:
        found = self.cache.get(members)
        if found is None:
            chosen = [self.jobs[i] for i in sorted(members)]
            samples = simulate_group(chosen)
            names = [j.name for j in chosen]
            window = active_window(samples, names, _WARMUP)
            duty = duty_by_group(samples, window).get("g", 0.0)
            steps = {n: mean_step_seconds(samples, n, _WARMUP) for n in names}
            found = self.cache[members] = _GroupOutcome(duty, steps)
        return found

    def alone_holds(self, i: int) -> list[tuple[float, float]]:
        samples = simulate_group([self.jobs[i]])
        spans: dict[int, list[float]] = {}
        for s in samples:
            if s.phase.on_accelerator:
                spans.setdefault(s.step, []).extend((s.start, s.end))
        return [(min(v), max(v)) for _, v in sorted(spans.items())]

    def evaluate(self, blocks: Sequence[frozenset[int]]) -> tuple[float, float]:
        """(aggregate duty, worst slowdown) of a plan given as groups of job indexes."""
        duties = []
        worst = 1.0
        for block in blocks:
            outcome = self.group(block)
            duties.append(outcome.duty)
            for i in block:
                alone = self.group(frozenset({i})).step_seconds[self.jobs[i].name]
                worst = max(worst, outcome.step_seconds[self.jobs[i].name] / alone)
        return statistics.fmean(duties), worst


# ---------------------------------------------------------------------------------------------
# Plans


@dataclass(frozen=True)
class PlanResult:
    plan: str
    groups: int
    duty: float
    worst_slowdown: float
    predicted_duty: float | None = None
    unplaced: int = 0
    blocks: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class DrawResult:
    draw: int
    jobs: int
    pool: int
    mix: str
    plans: dict[str, PlanResult]
    seconds: float


def _blocks_of(placement: Placement, slots: Sequence[Slot]) -> list[frozenset[int]]:
    index = {s: i for i, s in enumerate(slots)}
    return [frozenset(index[s] for s in g.members) for g in placement.groups]


def _partitions(items: Sequence[int], most: int) -> Iterator[list[list[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _partitions(rest, most):
        for k in range(len(partition)):
            yield [*partition[:k], [first, *partition[k]], *partition[k + 1 :]]
        if len(partition) < most:
            yield [[first], *partition]


def run_draw(
    draw: int,
    n: int,
    *,
    seed: int,
    steps: int,
    busy40: bool,
    cap: float,
    exhaustive_max: int,
) -> DrawResult:
    """Every plan of one draw, on the same simulated jobs."""
    began = time.perf_counter()
    jobs = make_jobs(n, seed, draw, busy40=busy40, steps=steps)
    pool_size = math.ceil(0.75 * n)
    pool = [f"g{k}" for k in range(pool_size)]
    slots = [Slot(j.name) for j in jobs]
    timeline = _Timeline(jobs)
    constraints = Constraints(cap=cap)
    plans: dict[str, PlanResult] = {}

    def record(name: str, blocks: list[frozenset[int]], predicted: float | None = None) -> None:
        duty, worst = timeline.evaluate(blocks)
        plans[name] = PlanResult(
            name,
            len(blocks),
            duty,
            worst,
            predicted,
            n - sum(len(b) for b in blocks),
            [sorted(b) for b in blocks],
        )

    record("dedicated", [frozenset({i}) for i in range(n)])
    order = list(range(n))
    random.Random(f"placement:random:{seed}:{draw}:{n}").shuffle(order)
    record("random", [frozenset(order[k : k + 2]) for k in range(0, n, 2)])

    # On arrival: declared profiles, earlier jobs running where they were put.
    placed: dict[Slot, str] = {}
    for i, job in enumerate(jobs):
        demands = [
            Demand(slots[k], jobs[k].declared(), JobState.RUNNING, placed[slots[k]])
            for k in range(i)
            if slots[k] in placed
        ]
        demands.append(Demand(slots[i], job.declared()))
        got = place(pool, demands, constraints).group_of(slots[i])
        if got is not None:
            placed[slots[i]] = got
    arrival = [frozenset(i for i, s in enumerate(slots) if placed.get(s) == g) for g in pool]
    record("ours-on-arrival", [b for b in arrival if b])

    # At the restart point: measured profiles, every job free to move (hysteresis applies).
    measured = [
        JobProfile.measured(timeline.alone_holds(i), mode=j.mode, switch_seconds=j.switch_seconds)
        for i, j in enumerate(jobs)
    ]
    demands = [
        Demand(slots[i], measured[i], JobState.AT_RESTART_POINT, placed[slots[i]])
        if slots[i] in placed
        else Demand(slots[i], measured[i])
        for i in range(n)
    ]
    ours = place(pool, demands, constraints)
    record("ours", _blocks_of(ours, slots), ours.duty)

    if n <= exhaustive_max:
        fresh = [Demand(slots[i], measured[i]) for i in range(n)]
        best_model = place_exhaustive(pool, fresh, constraints)
        record("exhaustive-model", _blocks_of(best_model, slots), best_model.duty)
        best: tuple[float, float, list[frozenset[int]]] | None = None
        for partition in _partitions(list(range(n)), pool_size):
            blocks = [frozenset(b) for b in partition]
            if any(
                len(b) > 1 and nominal_load([measured[i] for i in b]) > cap + 1e-9 for b in blocks
            ):
                continue
            duty, worst = timeline.evaluate(blocks)
            if best is None or (duty, -worst) > (best[0], -best[1]):
                best = (duty, worst, blocks)
        if best is not None:
            record("optimum", best[2])
    mix = "40% busy" if busy40 else "20-60% busy"
    return DrawResult(draw, n, pool_size, mix, plans, time.perf_counter() - began)


# ---------------------------------------------------------------------------------------------
# Report


def summarise(results: Sequence[DrawResult]) -> dict[str, Any]:
    """Per mix and N: mean duty and worst slowdown per plan, and the target ratios."""
    out: dict[str, Any] = {}
    keys = sorted({(r.mix, r.jobs) for r in results})
    for mix, n in keys:
        rows = [r for r in results if r.mix == mix and r.jobs == n]
        names = sorted({p for r in rows for p in r.plans})
        entry: dict[str, Any] = {"draws": len(rows)}
        for name in names:
            have = [r.plans[name] for r in rows if name in r.plans]
            entry[name] = {
                "duty": statistics.fmean(p.duty for p in have),
                "worst_slowdown": statistics.fmean(p.worst_slowdown for p in have),
                "groups": statistics.fmean(p.groups for p in have),
                "unplaced": sum(p.unplaced for p in have),
            }
        with_opt = [r for r in rows if "optimum" in r.plans]
        if with_opt:
            ratios = [r.plans["ours"].duty / r.plans["optimum"].duty for r in with_opt]
            gaps = [
                r.plans["ours"].worst_slowdown - r.plans["optimum"].worst_slowdown for r in with_opt
            ]
            entry["ours_over_optimum_duty"] = {"mean": statistics.fmean(ratios), "min": min(ratios)}
            entry["ours_minus_optimum_worst_slowdown"] = {
                "mean": statistics.fmean(gaps),
                "max": max(gaps),
            }
        over_dedicated = [r.plans["ours"].duty / r.plans["dedicated"].duty for r in rows]
        entry["ours_over_dedicated_duty"] = {
            "mean": statistics.fmean(over_dedicated),
            "min": min(over_dedicated),
        }
        out[f"{mix}, N={n}"] = entry
    return out


def targets(summary: dict[str, Any]) -> dict[str, bool]:
    """Issue 40's targets, on the means over draws."""
    met: dict[str, bool] = {}
    for key, entry in summary.items():
        if "ours_over_optimum_duty" in entry:
            met[f"{key}: ours >= 0.95 x optimum duty"] = (
                entry["ours_over_optimum_duty"]["mean"] >= 0.95
            )
            met[f"{key}: worst slowdown within 5 points of the optimum's"] = (
                entry["ours_minus_optimum_worst_slowdown"]["mean"] <= 0.05
            )
        if key.startswith("40% busy"):
            met[f"{key}: ours >= 1.5 x dedicated duty"] = (
                entry["ours_over_dedicated_duty"]["mean"] >= 1.5
            )
    return met


def _table(summary: dict[str, Any]) -> str:
    plans = ["dedicated", "random", "ours-on-arrival", "ours", "exhaustive-model", "optimum"]
    lines = ["mix, N | " + " | ".join(plans)]
    for key, entry in summary.items():
        cells = []
        for p in plans:
            e = entry.get(p)
            cells.append(
                "-"
                if e is None
                else f"{e['duty']:.3f} / x{e['worst_slowdown']:.2f} ({e['groups']:.1f})"
            )
        lines.append(f"{key} ({entry['draws']} draws) | " + " | ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.placement", description=__doc__)
    p.add_argument("--draws", type=int, default=10, help="draws per mix and N (default 10)")
    p.add_argument("--jobs", type=int, nargs="+", default=[6, 8, 10, 12], help="values of N")
    p.add_argument("--steps", type=int, default=_DURATION_STEPS_OF_100S,
                   help="run length in 100 s steps (default 60)")  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--cap", type=float, default=0.9)
    p.add_argument("--exhaustive-max", type=int, default=10,
                   help="largest N for the exhaustive plans (default 10)")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the results there")
    args = p.parse_args(argv)
    if not all(2 <= n <= 16 for n in args.jobs) or args.draws < 1 or args.steps < 5:
        p.error("N within 2..16, --draws >= 1 and --steps >= 5")
    began = time.perf_counter()
    results = [
        run_draw(
            d,
            n,
            seed=args.seed,
            steps=args.steps,
            busy40=busy40,
            cap=args.cap,
            exhaustive_max=args.exhaustive_max,
        )
        for busy40 in (False, True)
        for n in args.jobs
        for d in range(args.draws)
    ]
    summary = summarise(results)
    met = targets(summary)
    info = machine_info()
    print(LABEL)
    print(machine_line(info))
    print("duty / worst slowdown (groups used), means over draws")
    print(_table(summary))
    for name, ok in met.items():
        print(f"{'met' if ok else 'MISSED'}: {name}")
    print(f"{time.perf_counter() - began:.1f} s")
    if args.json:
        report = {
            "label": LABEL,
            "machine": info,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "summary": summary,
            "targets": met,
            "draws": [asdict(r) for r in results],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
