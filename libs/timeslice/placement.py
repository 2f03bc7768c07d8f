"""Automatic placement: which group of a pool each job's role should use, and why.

Pure functions, no I/O: the orchestrator (or a launcher, or a benchmark) gathers the inputs
and acts on the result. Inputs:

* the pool: its groups, in a stable order (the order breaks ties);
* one :class:`Demand` per (job, role): its :class:`JobProfile` (busy fraction, period,
  phase-to-phase variation, sync or async, switch cost; measured from the recorded holds, or
  declared, or :data:`DEFAULT_PROFILE`), its :class:`JobState` and the group it runs on now;
* :class:`Constraints`: the load cap of a group, pins, excluded pairs, drained groups.

A running job is never moved: only a job at a restart point (or one that asks) or a new job
gets a group. :func:`place` returns a :class:`Placement`: one :class:`Assignment` per demand
with a :class:`Reason` (typed fields, rendered by ``str``), each used group's
:class:`GroupForecast`, and whether everything fitted; when it did not, the best partial plan
and, per unplaced job, why each group refused it. Nothing raises except malformed input
(:class:`~timeslice.errors.InvalidArgument`, with the field named).

The model of a shared group (:func:`forecast`) is the load of :mod:`timeslice.plan` (busy
fractions plus each grant's switch time, checked against the cap) and a wait per hold for
collisions: a job that asks while another holds waits for the rest of that hold. Two jobs of
the same period and little variation lock into alternation (a FIFO group pushes the later one
behind the earlier and they keep that order), so they rarely collide; their measured phases
only cost the first, aligning, wait (amortised over ``horizon_steps``), which is why a pair in
antiphase scores better than the same pair in phase. Jobs of different periods, or jittery
ones, meet at random: a job finds another holding with the probability of that one's share of
time and then waits half its hold (more with variance). An async trainer absorbs waits up to
part of its slack (a batch of its samplers is not late until the wait exceeds that).
The model is checked against the simulated timeline of the workload generator
(``tests/bench/test_bench_placement.py``, ``python -m bench.placement``).

The search (:func:`place`): greedy by descending busy fraction (and a few other orders) into
the group that keeps the plan's score highest (aggregate duty, less a small charge for the
worst slowdown), then single moves, pair swaps, pairs of moves, rotations of three and
re-filling emptied groups while they improve it; :func:`place_exhaustive` tries every plan
(small pools; tests and the benchmark). docs/placement.md has the whole picture.
"""

from __future__ import annotations

import enum
import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from timeslice.errors import InvalidArgument

__all__ = [
    "DEFAULT_PROFILE",
    "Assignment",
    "Blocked",
    "BlockedBy",
    "Constraints",
    "Decision",
    "Demand",
    "GroupForecast",
    "JobProfile",
    "JobState",
    "Mode",
    "Placement",
    "Reason",
    "Slot",
    "Source",
    "forecast",
    "nominal_load",
    "place",
    "place_exhaustive",
]

# Two periods within this relative difference count as equal (the jobs can lock in step).
_SAME_PERIOD = 0.05
# Phase-to-phase variation (coefficient of variation, summed over a pair) at which a locked
# pair behaves like two random ones; calibrated on the workload generator's timeline.
_LOCK_CV = 0.6
# Share of an async trainer's slack (period - hold) that absorbs waits on the group.
_ASYNC_SLACK_USE = 0.5
# Collisions of jobs that meet at random cost this much more than a uniformly random arrival
# would (their requests bunch); calibrated on the workload generator's timeline.
_ALPHA = 1.2
# Above this many movable slots the exhaustive search refuses (it grows like Bell numbers).
_EXHAUSTIVE_LIMIT = 12
# Above this many movable slots the search skips its costlier moves (pairs of moves, rotations).
_DEEP_SEARCH_LIMIT = 14
_EPS = 1e-9


class Mode(enum.Enum):
    """How the job's accelerator phases are paced."""

    SYNC = "sync"  # each step waits for its own hold: every wait lengthens the step
    ASYNC = "async"  # a trainer fed by dedicated samplers: it has slack before a wait shows


class Source(enum.Enum):
    """Where a profile's numbers come from."""

    MEASURED = "measured"  # the recorded holds
    DECLARED = "declared"  # the job said so
    DEFAULT = "default"  # neither: the conservative default


@dataclass(frozen=True, slots=True)
class JobProfile:
    """What a job (one role) does with a group, alone on it.

    ``busy``: fraction of wall time it holds the group; ``period_seconds``: mean time from one
    hold's start to the next; ``cv``: phase-to-phase coefficient of variation (of the hold and
    of the period); ``switch_seconds``: what a context switch to this job costs (checkpoint of
    the resident plus restore of this one); ``phase``: where in its period its hold starts,
    as a fraction, measured on the shared wall clock (``None``: unknown).
    """

    busy: float
    period_seconds: float
    cv: float = 0.1
    mode: Mode = Mode.SYNC
    switch_seconds: float = 0.0
    source: Source = Source.DECLARED
    phase: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.busy <= 1:
            raise InvalidArgument(f"busy must be within (0, 1], got {self.busy!r}")
        if not (math.isfinite(self.period_seconds) and self.period_seconds > 0):
            raise InvalidArgument(f"period_seconds must be > 0, got {self.period_seconds!r}")
        if not 0 <= self.cv <= 5:
            raise InvalidArgument(f"cv must be within [0, 5], got {self.cv!r}")
        if not (math.isfinite(self.switch_seconds) and self.switch_seconds >= 0):
            raise InvalidArgument(f"switch_seconds must be >= 0, got {self.switch_seconds!r}")
        if self.phase is not None and not 0 <= self.phase < 1:
            raise InvalidArgument(f"phase must be within [0, 1), got {self.phase!r}")

    @property
    def hold_seconds(self) -> float:
        return self.busy * self.period_seconds

    @classmethod
    def measured(
        cls,
        holds: Sequence[tuple[float, float]],
        *,
        mode: Mode = Mode.SYNC,
        switch_seconds: float = 0.0,
    ) -> JobProfile:
        """The profile of recorded holds ``(start, end)`` (wall-clock seconds, any order).

        Needs at least three holds (two periods). The last period is open, so busy is the
        held time of all holds but the last over the time from the first start to the last.
        """
        ordered = sorted(holds)
        if len(ordered) < 3:
            raise InvalidArgument(f"a measured profile needs >= 3 holds, got {len(ordered)}")
        if any(end < start for start, end in ordered):
            raise InvalidArgument("a hold ends before it starts")
        starts = [s for s, _ in ordered]
        periods = [b - a for a, b in itertools.pairwise(starts)]
        span = starts[-1] - starts[0]
        if span <= 0:
            raise InvalidArgument("the holds all start at the same time")
        period = span / len(periods)
        held = [e - s for s, e in ordered[:-1]]
        busy = min(1.0, sum(held) / span)
        spread = [statistics.pstdev(periods) / period]
        if statistics.fmean(held) > 0:
            spread.append(statistics.pstdev(held) / statistics.fmean(held))
        # Circular mean of where each hold starts within the period.
        angles = [2 * math.pi * (s % period) / period for s in starts]
        x = statistics.fmean(math.cos(a) for a in angles)
        y = statistics.fmean(math.sin(a) for a in angles)
        phase = None if math.hypot(x, y) < 0.5 else (math.atan2(y, x) / (2 * math.pi)) % 1.0
        return cls(
            busy=max(busy, _EPS),
            period_seconds=period,
            cv=min(5.0, max(spread)),
            mode=mode,
            switch_seconds=switch_seconds,
            source=Source.MEASURED,
            phase=phase,
        )


DEFAULT_PROFILE = JobProfile(busy=0.6, period_seconds=100.0, cv=0.5, source=Source.DEFAULT)
"""A job that declared nothing and has no history: assumed busy and irregular, so it is not
packed tightly before it is measured."""


@dataclass(frozen=True, slots=True, order=True)
class Slot:
    """One role of one job: what gets a group."""

    job: str
    role: str = "main"

    def __str__(self) -> str:
        return f"{self.job}/{self.role}"


class JobState(enum.Enum):
    """Whether the job may be (re)placed now."""

    NEW = "new"  # not started: any group
    AT_RESTART_POINT = "at_restart_point"  # stopped at a restart point, or asked: may move
    RUNNING = "running"  # running: stays on its group whatever the plan says


@dataclass(frozen=True, slots=True)
class Demand:
    """One slot to place: its profile, its state and (unless new) its current group."""

    slot: Slot
    profile: JobProfile
    state: JobState = JobState.NEW
    group: str | None = None


@dataclass(frozen=True)
class Constraints:
    """The operator's rules and the model's knobs.

    ``cap``: the most load (busy fractions plus switch time) a shared group may carry;
    ``pins``: slots that must use a group; ``excluded``: pairs of jobs that never share a
    group; ``drained``: groups that take no new placement (what runs there stays);
    ``min_gain``: the least aggregate-duty gain worth moving a job at a restart point off its
    group; ``horizon_steps``: steps over which a first aligning wait is amortised;
    ``fairness``: aggregate duty traded for one unit of the worst job's slowdown.
    """

    cap: float = 0.9
    pins: Mapping[Slot, str] = field(default_factory=dict)
    excluded: frozenset[frozenset[str]] = frozenset()
    drained: frozenset[str] = frozenset()
    min_gain: float = 0.02
    horizon_steps: float = 20.0
    fairness: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.cap <= 1:
            raise InvalidArgument(f"cap must be within (0, 1], got {self.cap!r}")
        if self.min_gain < 0 or self.horizon_steps < 1 or self.fairness < 0:
            raise InvalidArgument("min_gain and fairness must be >= 0, horizon_steps >= 1")
        for pair in self.excluded:
            if len(pair) != 2:
                raise InvalidArgument(f"an excluded pair names two jobs, got {sorted(pair)}")

    def excludes(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self.excluded


class Decision(enum.Enum):
    """What happened to a slot."""

    KEPT = "kept"  # running: stays where it is
    PINNED = "pinned"  # an operator's pin
    PLACED = "placed"  # new: given a group
    MOVED = "moved"  # at a restart point: given another group
    STAYED = "stayed"  # at a restart point: its group is still the best
    UNPLACED = "unplaced"  # no group can take it (see Reason.blocked)


class BlockedBy(enum.Enum):
    """Why a group refused a slot."""

    DRAINED = "drained"
    EXCLUDED_PAIR = "excluded pair"
    OVER_CAP = "over the load cap"


@dataclass(frozen=True, slots=True)
class Blocked:
    group: str
    why: BlockedBy
    other_job: str = ""  # EXCLUDED_PAIR: the job it may not share with
    load: float = 0.0  # OVER_CAP: the group's load with this slot added

    def __str__(self) -> str:
        if self.why is BlockedBy.EXCLUDED_PAIR:
            return f"{self.group}: excluded with {self.other_job}"
        if self.why is BlockedBy.OVER_CAP:
            return f"{self.group}: load would be {self.load:.0%}"
        return f"{self.group}: drained"


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a slot got its group (or none): typed fields; ``str`` renders them for people."""

    decision: Decision
    group: str | None
    partners: tuple[Slot, ...] = ()
    load: float = 0.0
    cap: float = 0.0
    predicted_duty: float = 0.0
    slowdown: float = 1.0
    source: Source = Source.DECLARED
    previous_group: str | None = None
    over_cap: bool = False  # KEPT on a group whose load now exceeds the cap
    blocked: tuple[Blocked, ...] = ()

    def __str__(self) -> str:
        if self.decision is Decision.UNPLACED:
            why = "; ".join(str(b) for b in self.blocked) or "the pool has no group"
            return f"unplaced: no group can take it ({why})"
        head = {
            Decision.KEPT: f"kept on {self.group} (running; moves only at a restart point)",
            Decision.PINNED: f"pinned to {self.group}",
            Decision.PLACED: f"placed on {self.group}",
            Decision.MOVED: f"moved from {self.previous_group} to {self.group}",
            Decision.STAYED: f"stays on {self.group}",
        }[self.decision]
        alone = not self.partners
        shared = "alone" if alone else "with " + ", ".join(str(p) for p in self.partners)
        text = (
            f"{head}: {shared}; {self.source.value} profile; group load "
            f"{self.load:.0%} of cap {self.cap:.0%}, predicted duty {self.predicted_duty:.0%}, "
            f"slowdown x{self.slowdown:.2f}"
        )
        if self.over_cap:
            text += "; over the cap: re-placed at its next restart point"
        return text


@dataclass(frozen=True, slots=True)
class Assignment:
    slot: Slot
    group: str | None
    reason: Reason

    @property
    def decision(self) -> Decision:
        return self.reason.decision


@dataclass(frozen=True, slots=True)
class GroupForecast:
    """A group's predicted load (nominal, for the cap), duty and each member's slowdown."""

    group: str
    members: tuple[Slot, ...]
    load: float
    duty: float
    slowdowns: tuple[float, ...]

    @property
    def worst_slowdown(self) -> float:
        return max(self.slowdowns, default=1.0)


@dataclass(frozen=True, slots=True)
class Placement:
    """A whole plan: every slot's assignment, every used group's forecast."""

    assignments: tuple[Assignment, ...]
    groups: tuple[GroupForecast, ...]
    exhaustive: bool = False

    @property
    def feasible(self) -> bool:
        """Whether every slot got a group."""
        return all(a.group is not None for a in self.assignments)

    @property
    def unplaced(self) -> tuple[Assignment, ...]:
        return tuple(a for a in self.assignments if a.group is None)

    @property
    def duty(self) -> float:
        """Aggregate predicted duty: accelerator busy time over the groups in use."""
        if not self.groups:
            return 0.0
        return sum(g.duty for g in self.groups) / len(self.groups)

    @property
    def worst_slowdown(self) -> float:
        return max((g.worst_slowdown for g in self.groups), default=1.0)

    def group_of(self, slot: Slot) -> str | None:
        for a in self.assignments:
            if a.slot == slot:
                return a.group
        raise KeyError(str(slot))

    def mapping(self) -> dict[Slot, str]:
        """Slot -> group, for the placed slots."""
        return {a.slot: a.group for a in self.assignments if a.group is not None}


# ---------------------------------------------------------------------------------------------
# The model


def nominal_load(profiles: Sequence[JobProfile]) -> float:
    """What :mod:`timeslice.plan` checks against the cap: busy fractions, and when shared,
    every grant's switch (``switch_seconds`` per period)."""
    busy = sum(p.busy for p in profiles)
    if len(profiles) < 2:
        return busy
    return busy + sum(p.switch_seconds / p.period_seconds for p in profiles)


def _same_period(a: JobProfile, b: JobProfile) -> bool:
    return abs(a.period_seconds - b.period_seconds) <= _SAME_PERIOD * max(
        a.period_seconds, b.period_seconds
    )


def _lock(a: JobProfile, b: JobProfile) -> float:
    """How far two jobs stay in alternation once aligned (1: never collide again; 0: random)."""
    if not _same_period(a, b):
        return 0.0
    if a.busy + b.busy + (a.switch_seconds + b.switch_seconds) / a.period_seconds > 1:
        return 0.0
    return max(0.0, 1.0 - (a.cv + b.cv) / _LOCK_CV)


def _circular_overlap(a: JobProfile, b: JobProfile) -> float:
    """Seconds b's hold overlaps a's in one period at their measured phases (same period)."""
    assert a.phase is not None and b.phase is not None
    period = a.period_seconds
    total = 0.0
    a0, a1 = a.phase * period, a.phase * period + a.hold_seconds
    for shift in (-period, 0.0, period):
        b0 = b.phase * period + shift
        b1 = b0 + b.hold_seconds
        total += max(0.0, min(a1, b1) - max(a0, b0))
    return min(total, a.hold_seconds, b.hold_seconds)


def forecast(
    profiles: Sequence[JobProfile], *, horizon_steps: float = 20.0
) -> tuple[float, float, tuple[float, ...]]:
    """(nominal load, predicted duty, each job's predicted slowdown) of one group."""
    n = len(profiles)
    load = nominal_load(profiles)
    if n == 0:
        return 0.0, 0.0, ()
    if n == 1:
        return load, profiles[0].busy, (1.0,)
    slow = [1.0] * n
    for _ in range(4):  # fixed point: a slower job holds a smaller share of the time
        share = [
            (p.hold_seconds + p.switch_seconds) / (p.period_seconds * s)
            for p, s in zip(profiles, slow, strict=True)
        ]
        new = []
        for j, pj in enumerate(profiles):
            wait = pj.switch_seconds
            for i, pi in enumerate(profiles):
                if i == j:
                    continue
                residual = (pi.hold_seconds + pi.switch_seconds) * (1 + pi.cv * pi.cv) / 2
                lock = _lock(pi, pj)
                wait += _ALPHA * share[i] * (1 - lock) * residual
                if lock > 0 and pi.phase is not None and pj.phase is not None:
                    wait += lock * _circular_overlap(pi, pj) / horizon_steps
            if pj.mode is Mode.ASYNC:
                slack = _ASYNC_SLACK_USE * (pj.period_seconds - pj.hold_seconds)
                wait = max(0.0, wait - slack)
            new.append(1.0 + wait / pj.period_seconds)
        slow = new
    occupied = sum(
        (p.hold_seconds + p.switch_seconds) / (p.period_seconds * s)
        for p, s in zip(profiles, slow, strict=True)
    )
    if occupied > 1:  # saturated: the group serves at most all of its time
        slow = [s * occupied for s in slow]
    duty = sum(p.busy / s for p, s in zip(profiles, slow, strict=True))
    return load, duty, tuple(slow)


# ---------------------------------------------------------------------------------------------
# The search


@dataclass
class _Problem:
    groups: tuple[str, ...]
    demands: tuple[Demand, ...]
    constraints: Constraints
    fixed: dict[int, int]  # demand index -> group index (running, pinned)
    movable: tuple[int, ...]  # demand indexes the search assigns
    allowed: dict[int, tuple[int, ...]]  # movable demand -> groups it may use (not drained)
    cache: dict[frozenset[int], tuple[float, float, tuple[float, ...]]] = field(
        default_factory=dict
    )

    def group_forecast(self, members: frozenset[int]) -> tuple[float, float, tuple[float, ...]]:
        found = self.cache.get(members)
        if found is None:
            ordered = sorted(members)
            found = forecast(
                [self.demands[i].profile for i in ordered],
                horizon_steps=self.constraints.horizon_steps,
            )
            self.cache[members] = found
        return found

    def fits(self, members: frozenset[int]) -> bool:
        if (
            len(members) > 1
            and nominal_load([self.demands[i].profile for i in members])
            > self.constraints.cap + _EPS
        ):
            return False
        jobs = [self.demands[i].slot.job for i in members]
        return not any(
            a != b and self.constraints.excludes(a, b) for a, b in itertools.combinations(jobs, 2)
        )

    def score(self, plan: Mapping[int, int]) -> tuple[int, float, float]:
        """(slots placed, aggregate duty less the fairness charge, -worst slowdown): higher
        is better. Plans with as many groups differ by a few points of duty, about the
        model's error, so the worst job's slowdown is charged ``fairness`` per unit."""
        members: dict[int, set[int]] = {}
        for d, g in plan.items():
            members.setdefault(g, set()).add(d)
        duty = 0.0
        worst = 1.0
        for m in members.values():
            _, group_duty, slow = self.group_forecast(frozenset(m))
            duty += group_duty
            worst = max(worst, *slow)
        aggregate = duty / len(members) if members else 0.0
        value = aggregate - self.constraints.fairness * (worst - 1.0)
        return len(plan), round(value, 9), round(-worst, 9)

    def fits_in(self, plan: Mapping[int, int], group: int) -> bool:
        """Whether ``group`` fits the rules with its members in ``plan`` (a move only adds
        load to where it goes, so a trial checks its destinations)."""
        return self.fits(frozenset(d for d, g in plan.items() if g == group))

    def candidates(self, d: int, plan: Mapping[int, int]) -> list[int]:
        """The groups worth trying for ``d``: every allowed group in use, and the first
        allowed empty one (empty groups are interchangeable but for their order)."""
        used = set(plan.values())
        found = []
        empty = False
        for g in self.allowed[d]:
            if g in used:
                found.append(g)
            elif not empty:
                found.append(g)
                empty = True
        return found

    def feasible_plan(self, plan: Mapping[int, int]) -> bool:
        """Every group the search touched fits (fixed-only groups are not the search's to fix)."""
        members: dict[int, set[int]] = {}
        for d, g in plan.items():
            members.setdefault(g, set()).add(d)
        movable = set(self.movable)
        return all(self.fits(frozenset(m)) for m in members.values() if m & movable)


def _problem(
    groups: Sequence[str], demands: Sequence[Demand], constraints: Constraints
) -> _Problem:
    pool = tuple(groups)
    if len(set(pool)) != len(pool):
        raise InvalidArgument("the pool names a group twice")
    slots = [d.slot for d in demands]
    if len(set(slots)) != len(slots):
        raise InvalidArgument("a slot is demanded twice")
    index = {g: i for i, g in enumerate(pool)}
    for slot, group in constraints.pins.items():
        if group not in index:
            raise InvalidArgument(f"{slot} is pinned to {group}, which is not in the pool")
    fixed: dict[int, int] = {}
    movable: list[int] = []
    allowed: dict[int, tuple[int, ...]] = {}
    open_groups = tuple(i for i, g in enumerate(pool) if g not in constraints.drained)
    for n, d in enumerate(demands):
        if d.state is not JobState.NEW:
            if d.group is None:
                raise InvalidArgument(f"{d.slot} is {d.state.value} but names no group")
            if d.group not in index:
                raise InvalidArgument(f"{d.slot} runs on {d.group}, which is not in the pool")
        if d.state is JobState.RUNNING:
            assert d.group is not None
            fixed[n] = index[d.group]
        elif d.slot in constraints.pins:
            fixed[n] = index[constraints.pins[d.slot]]
        else:
            movable.append(n)
            allowed[n] = open_groups
    # Busiest first; the slot breaks ties, so the order never depends on the input's order.
    movable.sort(key=lambda n: (-demands[n].profile.busy, demands[n].slot))
    return _Problem(pool, tuple(demands), constraints, fixed, tuple(movable), allowed)


def _orders(problem: _Problem) -> list[tuple[int, ...]]:
    """The orders the greedy pass is started from: busiest first (the classic), then the
    longest holds, the longest periods, the most regular and the least busy first; the best
    result wins."""
    demands = problem.demands

    def by(key: Callable[[JobProfile], tuple[float, ...]]) -> tuple[int, ...]:
        return tuple(
            sorted(problem.movable, key=lambda n: (key(demands[n].profile), demands[n].slot))
        )

    orders = [
        problem.movable,
        by(lambda p: (-p.hold_seconds,)),
        by(lambda p: (-p.period_seconds, -p.busy)),
        by(lambda p: (p.cv, -p.busy)),
        problem.movable[::-1],  # least busy first: places the most slots in a tight pool
    ]
    return list(dict.fromkeys(orders))


def _greedy(
    problem: _Problem, order: Sequence[int], start: Mapping[int, int] | None = None
) -> dict[int, int]:
    plan = dict(problem.fixed if start is None else start)
    for d in order:
        best: tuple[tuple[int, float, float], int] | None = None
        for g in problem.candidates(d, plan):  # in pool order: the first of equal scores wins
            trial = {**plan, d: g}
            if not problem.fits_in(trial, g):
                continue
            score = problem.score(trial)
            if best is None or score > best[0]:
                best = (score, g)
        if best is not None:
            plan[d] = best[1]
    return plan


def _improve(
    problem: _Problem, plan: dict[int, int], rounds: int = 50, *, deep: bool = True
) -> dict[int, int]:
    """Single moves and pair swaps of movable slots while the score improves (first found);
    ``deep``: then pairs of moves and rotations of three (small pools only: they cost N^2 K^2
    and N^3 trials)."""
    current = problem.score(plan)
    movable = list(problem.movable)
    deep = deep and len(movable) <= _DEEP_SEARCH_LIMIT
    for _ in range(rounds):
        improved = False
        for d in movable:
            for g in problem.candidates(d, plan):
                if plan.get(d) == g:
                    continue
                trial = {**plan, d: g}
                if problem.fits_in(trial, g):
                    score = problem.score(trial)
                    if score > current:
                        plan, current, improved = trial, score, True
        for a, b in itertools.combinations(movable, 2):
            ga, gb = plan.get(a), plan.get(b)
            if ga is None or gb is None or ga == gb:
                continue
            if gb not in problem.allowed[a] or ga not in problem.allowed[b]:
                continue
            trial = {**plan, a: gb, b: ga}
            if problem.fits_in(trial, ga) and problem.fits_in(trial, gb):
                score = problem.score(trial)
                if score > current:
                    plan, current, improved = trial, score, True
        if not improved:
            if not deep:
                break
            found = _double_move(problem, plan, current) or _rotation(problem, plan, current)
            if found is None:
                break
            plan, current = found
    return plan


def _rebuild(
    problem: _Problem, score: tuple[int, float, float], plan: dict[int, int], rounds: int = 5
) -> dict[int, int]:
    """Large moves: empty one or two groups of their movable slots, put those back greedily
    (busiest first, then least busy first) and improve; keep the result when it scores
    better. It reaches plans that differ from a local optimum by more than three slots."""
    for _ in range(rounds):
        improved = False
        used = sorted({g for d, g in plan.items() if d in problem.allowed})
        for pair in itertools.chain.from_iterable(itertools.combinations(used, k) for k in (1, 2)):
            # The unplaced slots are put back too: room made here may take them.
            freed = [d for d in problem.movable if d not in plan or plan[d] in pair]
            if not freed:
                continue
            kept = {d: g for d, g in plan.items() if d not in freed}
            # Busiest first packs well; least busy first places the most slots.
            for order in (freed, freed[::-1]):
                trial = _improve(problem, _greedy(problem, order, kept), deep=False)
                trial_score = problem.score(trial)
                if trial_score > score:
                    plan, score, improved = trial, trial_score, True
                    break
            if improved:
                break
        if not improved:
            break
    return plan


def _rotation(
    problem: _Problem, plan: dict[int, int], current: tuple[int, float, float]
) -> tuple[dict[int, int], tuple[int, float, float]] | None:
    """The first rotation of three slots of three groups (a to b's, b to c's, c to a's)
    that improves the score: two swaps in a row often pass through a worse plan."""
    placed = [d for d in problem.movable if d in plan]
    for trio in itertools.permutations(placed, 3):
        a, b, c = trio
        if a > min(trio):  # each cycle once per direction
            continue
        ga, gb, gc = plan[a], plan[b], plan[c]
        if len({ga, gb, gc}) < 3:
            continue
        if gb not in problem.allowed[a] or gc not in problem.allowed[b]:
            continue
        if ga not in problem.allowed[c]:
            continue
        trial = {**plan, a: gb, b: gc, c: ga}
        if all(problem.fits_in(trial, g) for g in (ga, gb, gc)):
            score = problem.score(trial)
            if score > current:
                return trial, score
    return None


def _double_move(
    problem: _Problem, plan: dict[int, int], current: tuple[int, float, float]
) -> tuple[dict[int, int], tuple[int, float, float]] | None:
    """The first pair of simultaneous moves that improves the score: what single moves and
    swaps cannot reach when the step between is worse (emptying a group needs two)."""
    for a, b in itertools.combinations(problem.movable, 2):
        for ga in problem.candidates(a, plan):
            if plan.get(a) == ga:
                continue
            first = {**plan, a: ga}
            for gb in problem.candidates(b, first):
                if plan.get(b) == gb:
                    continue
                trial = {**first, b: gb}
                if problem.fits_in(trial, ga) and problem.fits_in(trial, gb):
                    score = problem.score(trial)
                    if score > current:
                        return trial, score
    return None


def _keep_at_restart_points(problem: _Problem, plan: dict[int, int]) -> dict[int, int]:
    """Put back a job at a restart point whose move gains less than ``min_gain``."""
    index = {g: i for i, g in enumerate(problem.groups)}
    for d in problem.movable:
        demand = problem.demands[d]
        if demand.state is not JobState.AT_RESTART_POINT or demand.group is None:
            continue
        home = index[demand.group]
        if plan.get(d) == home or home not in problem.allowed[d]:
            continue
        trial = {**plan, d: home}
        if not problem.feasible_plan(trial):
            continue
        placed, duty, _ = problem.score(plan)
        t_placed, t_duty, _ = problem.score(trial)
        if t_placed >= placed and duty - t_duty < problem.constraints.min_gain:
            plan = trial
    return plan


def _render(problem: _Problem, plan: Mapping[int, int], exhaustive: bool) -> Placement:
    members: dict[int, list[int]] = {}
    for d, g in plan.items():
        members.setdefault(g, []).append(d)
    forecasts: dict[int, GroupForecast] = {}
    slowdown: dict[int, float] = {}
    for g, ds in sorted(members.items()):
        ordered = sorted(ds)
        load, duty, slow = problem.group_forecast(frozenset(ordered))
        forecasts[g] = GroupForecast(
            problem.groups[g], tuple(problem.demands[d].slot for d in ordered), load, duty, slow
        )
        slowdown.update(zip(ordered, slow, strict=True))
    cap = problem.constraints.cap
    out = []
    for d, demand in enumerate(problem.demands):
        where = plan.get(d)
        if where is None:
            out.append(
                Assignment(
                    demand.slot,
                    None,
                    Reason(
                        Decision.UNPLACED,
                        None,
                        cap=cap,
                        source=demand.profile.source,
                        previous_group=demand.group,
                        blocked=_blocked(problem, plan, d),
                    ),
                )
            )
            continue
        group = problem.groups[where]
        if demand.state is JobState.RUNNING:
            decision = Decision.KEPT
        elif demand.slot in problem.constraints.pins:
            decision = Decision.PINNED
        elif demand.state is JobState.AT_RESTART_POINT:
            decision = Decision.STAYED if demand.group == group else Decision.MOVED
        else:
            decision = Decision.PLACED
        fc = forecasts[where]
        out.append(
            Assignment(
                demand.slot,
                group,
                Reason(
                    decision,
                    group,
                    partners=tuple(s for s in fc.members if s != demand.slot),
                    load=fc.load,
                    cap=cap,
                    predicted_duty=fc.duty,
                    slowdown=slowdown[d],
                    source=demand.profile.source,
                    previous_group=demand.group,
                    over_cap=decision is Decision.KEPT
                    and len(fc.members) > 1
                    and fc.load > cap + _EPS,
                ),
            )
        )
    return Placement(tuple(out), tuple(forecasts[g] for g in sorted(forecasts)), exhaustive)


def _blocked(problem: _Problem, plan: Mapping[int, int], d: int) -> tuple[Blocked, ...]:
    found = []
    job = problem.demands[d].slot.job
    for g, name in enumerate(problem.groups):
        if g not in problem.allowed[d]:
            found.append(Blocked(name, BlockedBy.DRAINED))
            continue
        others = sorted(k for k, v in plan.items() if v == g)
        excluded = [
            problem.demands[k].slot.job
            for k in others
            if problem.constraints.excludes(job, problem.demands[k].slot.job)
        ]
        if excluded:
            found.append(Blocked(name, BlockedBy.EXCLUDED_PAIR, other_job=excluded[0]))
            continue
        load = nominal_load([problem.demands[k].profile for k in [*others, d]])
        found.append(Blocked(name, BlockedBy.OVER_CAP, load=load))
    return tuple(found)


def place(
    groups: Sequence[str],
    demands: Iterable[Demand],
    constraints: Constraints | None = None,
) -> Placement:
    """The plan for ``demands`` on the pool ``groups`` (see the module doc).

    Running slots keep their group; pinned slots get their pin; the others are placed by a
    greedy pass (from a few orders, busiest first among them), then improved by moves,
    swaps and pairs of moves; the best plan wins. Deterministic: the same inputs in any
    order give the same plan.
    """
    problem = _problem(groups, list(demands), constraints or Constraints())
    best: tuple[tuple[int, float, float], dict[int, int]] | None = None
    for order in _orders(problem):
        plan = _improve(problem, _greedy(problem, order))
        score = problem.score(plan)
        if best is None or score > best[0]:
            best = (score, plan)
    assert best is not None
    plan = _keep_at_restart_points(problem, _rebuild(problem, *best))
    return _render(problem, plan, exhaustive=False)


def _search_all(problem: _Problem) -> dict[int, int]:
    """Branch and bound over every plan of the movable slots (each in one of its groups, or
    unplaced). Groups with nothing fixed on them that every slot may use are interchangeable,
    so a slot only opens the first unused one of them; a branch is cut as soon as a group
    breaks a constraint, or when it cannot place as many slots as the best plan so far."""
    movable = problem.movable
    fixed_groups = set(problem.fixed.values())
    every = set.intersection(*(set(problem.allowed[d]) for d in movable)) if movable else set()
    blank = [g for g in range(len(problem.groups)) if g in every and g not in fixed_groups]
    blank_set = set(blank)
    best: list[tuple[tuple[int, float, float], dict[int, int]]] = []
    plan = dict(problem.fixed)
    members: dict[int, set[int]] = {}
    for d, g in plan.items():
        members.setdefault(g, set()).add(d)

    def visit(k: int, opened: int) -> None:
        if best and len(plan) + len(movable) - k < best[0][0][0]:
            return
        if k == len(movable):
            score = problem.score(plan)
            if not best or score > best[0][0]:
                best[:] = [(score, dict(plan))]
            return
        d = movable[k]
        for g in problem.allowed[d]:
            new_blank = g in blank_set and not members.get(g)
            if new_blank and (opened >= len(blank) or g != blank[opened]):
                continue
            group = members.setdefault(g, set())
            group.add(d)
            if problem.fits(frozenset(group)):
                plan[d] = g
                visit(k + 1, opened + 1 if new_blank else opened)
                del plan[d]
            group.discard(d)
        visit(k + 1, opened)  # unplaced

    visit(0, 0)
    return best[0][1]


def place_exhaustive(
    groups: Sequence[str],
    demands: Iterable[Demand],
    constraints: Constraints | None = None,
) -> Placement:
    """The best plan by the same score as :func:`place`, trying every assignment.

    For small pools only: raises :class:`~timeslice.errors.InvalidArgument` above 12 slots
    to place (the plans grow like Bell numbers).
    """
    problem = _problem(groups, list(demands), constraints or Constraints())
    if len(problem.movable) > _EXHAUSTIVE_LIMIT:
        raise InvalidArgument(
            f"{len(problem.movable)} slots to place: more than the exhaustive search's "
            f"{_EXHAUSTIVE_LIMIT}"
        )
    return _render(problem, _search_all(problem), exhaustive=True)
