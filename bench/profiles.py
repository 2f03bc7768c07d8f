"""Synthetic RL job profiles: what one step of a job does, and for how long.

A profile describes one step of a job *in real seconds* (as it would run on real
accelerators); the workload generator (:mod:`bench.workload`) multiplies every duration by a
time-scale factor so that a benchmark run finishes in minutes. A step is a sequence of
segments:

* :class:`OffPhase` - time off the accelerators (reward models on CPU, environments,
  sandboxes): a plain wait.
* :class:`Hold` - one ``acquire`` ... ``yield`` of a group covering consecutive accelerator
  phases (rollout, logprob, train, weight sync), the way a synchronous GRPO job uses
  ``on_accelerators``. A profile whose phases use separate groups lists several holds with
  different ``role`` names; a run maps each role to a group.

Asynchronous RL (:class:`AsyncSampler` set) differs: the shared trainer waits for rollout
batches produced by dedicated, unshared samplers. Batch production is modelled as time off the
accelerators for the trainer, bounded by a staleness limit ``k`` (the sampler may run at most
``k`` policy versions ahead of the trainer).

Durations are random: each phase has a mean and a :data:`Spread` (gamma jitter with a given
coefficient of variation, or a log-normal tail with a given p99/median ratio), always with the
stated mean, so a profile's long-run fractions are exactly the documented ones.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass, field

__all__ = [
    "PROFILES",
    "STEP_SECONDS",
    "Z99",
    "AsyncSampler",
    "DrawnHold",
    "DrawnOff",
    "DrawnPhase",
    "Hold",
    "Jitter",
    "JobDraws",
    "LogNormalTail",
    "OffPhase",
    "PhaseSpec",
    "Profile",
    "Spread",
    "StepPhase",
    "StepPlan",
    "draw_job",
    "get_profile",
]

# The standard normal quantile at 0.99: p99 of a log-normal is median * exp(Z99 * sigma).
Z99 = 2.3263478740408408
# Real seconds of one step of a job alone on its accelerators (every built-in profile). The
# targets in docs/benchmarks.md are stated for this step length; switch costs are compared
# with it (analytic bound: s / STEP_SECONDS).
STEP_SECONDS = 100.0


class StepPhase(enum.Enum):
    """What a job is doing in one RL step; accelerator phases are the ones a duty cycle counts.

    The modelled counterpart of :class:`timeslice_tools.dev.timeline.DemoPhase` (demo runs),
    with async RL's phases too; the values differ, and both are written to result files.
    """

    ROLLOUT = "rollout"
    LOGPROB = "logprob"
    TRAIN = "train"
    SYNC = "sync"  # weight sync from the trainer to the inference engines
    REWARD = "reward"  # off the accelerators: reward models, environments, sandboxes
    BATCH_WAIT = "batch_wait"  # async RL: the trainer waits for a rollout batch
    QUEUE = "queue"  # from calling acquire until the grant (queueing and switching)

    @property
    def on_accelerator(self) -> bool:
        return self in _ACCELERATOR_PHASES


_ACCELERATOR_PHASES = frozenset(
    {StepPhase.ROLLOUT, StepPhase.LOGPROB, StepPhase.TRAIN, StepPhase.SYNC}
)


@dataclass(frozen=True)
class Jitter:
    """Gamma-distributed factor with mean 1 and coefficient of variation ``cv`` (0: fixed)."""

    cv: float = 0.1

    def __post_init__(self) -> None:
        if not 0 <= self.cv <= 2:
            raise ValueError(f"cv must be within [0, 2], got {self.cv}")

    def factor(self, rng: random.Random) -> float:
        if self.cv == 0:
            return 1.0
        shape = 1.0 / (self.cv * self.cv)
        return rng.gammavariate(shape, 1.0 / shape)


@dataclass(frozen=True)
class LogNormalTail:
    """Log-normal factor with mean 1 whose p99 is ``p99_over_median`` times its median."""

    p99_over_median: float = 10.0

    def __post_init__(self) -> None:
        if self.p99_over_median <= 1:
            raise ValueError(f"p99_over_median must be > 1, got {self.p99_over_median}")

    @property
    def sigma(self) -> float:
        return math.log(self.p99_over_median) / Z99

    @property
    def median(self) -> float:
        """The median factor: below 1 because the mean (1) sits in the tail's pull."""
        return math.exp(-self.sigma * self.sigma / 2)

    def factor(self, rng: random.Random) -> float:
        return rng.lognormvariate(math.log(self.median), self.sigma)


Spread = Jitter | LogNormalTail


@dataclass(frozen=True)
class PhaseSpec:
    """One phase of a hold: its mean duration in real seconds and how it varies."""

    phase: StepPhase
    mean_seconds: float
    spread: Spread = field(default_factory=Jitter)

    def __post_init__(self) -> None:
        if not self.phase.on_accelerator:
            raise ValueError(f"{self.phase.value} is not an accelerator phase")
        if self.mean_seconds < 0:
            raise ValueError(f"{self.phase.value}: mean_seconds must be >= 0")


@dataclass(frozen=True)
class OffPhase:
    """Time off the accelerators (no acquire)."""

    mean_seconds: float
    spread: Spread = field(default_factory=Jitter)
    phase: StepPhase = StepPhase.REWARD

    def __post_init__(self) -> None:
        if self.phase.on_accelerator:
            raise ValueError(f"{self.phase.value} is an accelerator phase")
        if self.mean_seconds < 0:
            raise ValueError("mean_seconds must be >= 0")


@dataclass(frozen=True)
class Hold:
    """One acquire of the group playing ``role``, covering consecutive accelerator phases."""

    phases: tuple[PhaseSpec, ...]
    role: str = "main"

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a hold needs at least one phase")

    @property
    def mean_seconds(self) -> float:
        return sum(p.mean_seconds for p in self.phases)


@dataclass(frozen=True)
class AsyncSampler:
    """Dedicated (unshared) samplers feeding an async trainer.

    Each rollout batch takes ``batch_seconds`` (mean, real seconds) to produce; batch ``b``
    may only start once the trainer has published policy version ``b - staleness``.
    """

    batch_seconds: float
    staleness: int = 1
    spread: Spread = field(default_factory=Jitter)

    def __post_init__(self) -> None:
        if self.batch_seconds <= 0:
            raise ValueError("batch_seconds must be > 0")
        if self.staleness < 0:
            raise ValueError("staleness must be >= 0")


Segment = OffPhase | Hold


@dataclass(frozen=True)
class DrawnPhase:
    phase: StepPhase
    seconds: float


@dataclass(frozen=True)
class DrawnOff:
    phase: StepPhase
    seconds: float


@dataclass(frozen=True)
class DrawnHold:
    role: str
    phases: tuple[DrawnPhase, ...]

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)


DrawnSegment = DrawnOff | DrawnHold


@dataclass(frozen=True)
class StepPlan:
    """One step's drawn durations (real seconds), in order."""

    segments: tuple[DrawnSegment, ...]

    @property
    def accelerator_seconds(self) -> float:
        return sum(s.seconds for s in self.segments if isinstance(s, DrawnHold))

    @property
    def off_seconds(self) -> float:
        return sum(s.seconds for s in self.segments if isinstance(s, DrawnOff))

    def phase_seconds(self) -> dict[StepPhase, float]:
        out: dict[StepPhase, float] = {}
        for segment in self.segments:
            parts = segment.phases if isinstance(segment, DrawnHold) else (segment,)
            for p in parts:
                out[p.phase] = out.get(p.phase, 0.0) + p.seconds
        return out


@dataclass(frozen=True)
class Profile:
    """A synthetic RL job: its step (segments) and, for async RL, its samplers."""

    name: str
    title: str
    segments: tuple[Segment, ...]
    sampler: AsyncSampler | None = None

    def __post_init__(self) -> None:
        if not any(isinstance(s, Hold) for s in self.segments):
            raise ValueError(f"profile {self.name}: a step needs at least one hold")
        if self.sampler is not None and any(isinstance(s, OffPhase) for s in self.segments):
            raise ValueError(
                f"profile {self.name}: an async profile's off-accelerator time is its sampler"
            )

    @property
    def roles(self) -> tuple[str, ...]:
        """The group roles this profile acquires, in first-use order."""
        seen: list[str] = []
        for s in self.segments:
            if isinstance(s, Hold) and s.role not in seen:
                seen.append(s.role)
        return tuple(seen)

    @property
    def accelerator_seconds(self) -> float:
        """Mean accelerator seconds per step."""
        return sum(s.mean_seconds for s in self.segments if isinstance(s, Hold))

    @property
    def step_seconds(self) -> float:
        """Mean wall seconds of a step of this job alone (no queueing, no switches)."""
        own = sum(s.mean_seconds for s in self.segments)
        if self.sampler is None:
            return own
        # The trainer cannot go faster than batches arrive, nor faster than it trains.
        return max(own, self.sampler.batch_seconds)

    @property
    def busy_fraction(self) -> float:
        """Fraction of wall time the job alone keeps its accelerators busy."""
        return self.accelerator_seconds / self.step_seconds

    def accelerator_fractions(self) -> dict[StepPhase, float]:
        """Each accelerator phase's share of the accelerator time (means)."""
        total = self.accelerator_seconds
        out: dict[StepPhase, float] = {}
        for s in self.segments:
            if isinstance(s, Hold):
                for p in s.phases:
                    out[p.phase] = out.get(p.phase, 0.0) + p.mean_seconds / total
        return out

    def sample_step(self, rng: random.Random) -> StepPlan:
        """Draw one step's durations (real seconds)."""
        drawn: list[DrawnSegment] = []
        for s in self.segments:
            if isinstance(s, OffPhase):
                drawn.append(DrawnOff(s.phase, s.mean_seconds * s.spread.factor(rng)))
            else:
                drawn.append(
                    DrawnHold(
                        s.role,
                        tuple(
                            DrawnPhase(p.phase, p.mean_seconds * p.spread.factor(rng))
                            for p in s.phases
                        ),
                    )
                )
        return StepPlan(tuple(drawn))

    def sample_batch(self, rng: random.Random) -> float:
        """Draw one sampler batch's production time (real seconds); async profiles only."""
        if self.sampler is None:
            raise ValueError(f"profile {self.name} has no sampler")
        return self.sampler.batch_seconds * self.sampler.spread.factor(rng)


@dataclass(frozen=True)
class JobDraws:
    """Everything random about one job of a run, drawn up front (real seconds)."""

    plans: list[StepPlan]
    batches: list[float]  # async profiles: each batch's production time
    offset: float  # before the first step: independent jobs do not start in phase


def draw_job(profile: Profile, index: int, steps: int, seed: int) -> JobDraws:
    """The draws of job ``index``: the same for its dedicated and shared runs (and the model)."""
    # String seeds are hashed deterministically (sha512), unlike hash() of a tuple.
    rng = random.Random(f"{seed}:{profile.name}:{index}:steps")
    offset = rng.uniform(0.0, profile.step_seconds)
    plans = [profile.sample_step(rng) for _ in range(steps)]
    batches: list[float] = []
    if profile.sampler is not None:
        brng = random.Random(f"{seed}:{profile.name}:{index}:batches")
        batches = [profile.sample_batch(brng) for _ in range(steps)]
    return JobDraws(plans, batches, offset)


def sync_profile(
    name: str,
    title: str,
    fractions: dict[StepPhase, float],
    busy: float,
    *,
    step_seconds: float = STEP_SECONDS,
    spreads: dict[StepPhase, Spread] | None = None,
) -> Profile:
    """A synchronous-RL profile: off-accelerator time, then one hold of ``fractions``' phases.

    ``fractions`` are shares of the accelerator time (they must sum to 1); ``busy`` is the
    fraction of the step spent on the accelerators when the job runs alone.
    """
    if not 0 < busy <= 1:
        raise ValueError(f"busy must be within (0, 1], got {busy}")
    if not math.isclose(sum(fractions.values()), 1.0, abs_tol=1e-9):
        raise ValueError(f"accelerator fractions must sum to 1, got {sum(fractions.values())}")
    spreads = spreads or {}
    accelerator = busy * step_seconds
    phases = tuple(
        PhaseSpec(phase, share * accelerator, spreads.get(phase, Jitter()))
        for phase, share in fractions.items()
    )
    segments: list[Segment] = []
    if busy < 1:
        segments.append(
            OffPhase((1 - busy) * step_seconds, spreads.get(StepPhase.REWARD, Jitter()))
        )
    segments.append(Hold(phases))
    return Profile(name, title, tuple(segments))


def _builtin() -> dict[str, Profile]:
    balanced = {
        StepPhase.ROLLOUT: 0.60,
        StepPhase.LOGPROB: 0.07,
        StepPhase.TRAIN: 0.32,
        StepPhase.SYNC: 0.01,
    }
    trainer_busy = 0.42
    profiles = [
        sync_profile(
            "balanced", "sync GRPO, balanced (rollout/logprob/train/sync, 40% busy)",
            balanced, 0.40,
        ),
        sync_profile(
            "rollout-heavy", "sync GRPO, rollout-heavy (84% of accelerator time rollout, "
            "40% busy)",
            {StepPhase.ROLLOUT: 0.84, StepPhase.TRAIN: 0.14, StepPhase.SYNC: 0.02}, 0.40,
        ),
        # The brief gives rollout 0.49, train 0.38, logprob 0.07 of the accelerator time and
        # 55% busy; the remaining 0.06 of the accelerator time is weight sync.
        sync_profile(
            "train-heavy", "sync GRPO, train-heavy (38% of accelerator time training, 55% busy)",
            {StepPhase.ROLLOUT: 0.49, StepPhase.LOGPROB: 0.07, StepPhase.TRAIN: 0.38,
             StepPhase.SYNC: 0.06},
            0.55,
        ),
        Profile(
            "async",
            "async RL, shared trainer only (dedicated samplers, staleness 1, trainer 42% busy)",
            (
                Hold((
                    PhaseSpec(StepPhase.TRAIN, 0.92 * trainer_busy * STEP_SECONDS),
                    PhaseSpec(StepPhase.SYNC, 0.08 * trainer_busy * STEP_SECONDS),
                )),
            ),
            sampler=AsyncSampler(batch_seconds=STEP_SECONDS, staleness=1),
        ),
        sync_profile(
            "long-tail", "sync GRPO with a long rollout tail (log-normal, p99 = 10x median)",
            balanced, 0.40, spreads={StepPhase.ROLLOUT: LogNormalTail(10.0)},
        ),
        # A diagnostic twin of "balanced": every duration exactly its mean, so the jobs
        # settle into perfect alternation and only switch costs separate duty from its bound.
        sync_profile(
            "balanced-fixed", "sync GRPO, balanced, fixed durations (no jitter; diagnostic)",
            balanced, 0.40, spreads={p: Jitter(0.0) for p in (*balanced, StepPhase.REWARD)},
        ),
    ]  # fmt: skip
    return {p.name: p for p in profiles}


PROFILES: dict[str, Profile] = _builtin()
"""The built-in profiles by name (see docs/benchmarks.md for the table)."""


def get_profile(name: str) -> Profile:
    """The built-in profile ``name``; raises ValueError listing the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(
            f"unknown profile {name!r}; known: {', '.join(sorted(PROFILES))}"
        ) from None
