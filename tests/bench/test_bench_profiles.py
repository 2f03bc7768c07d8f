"""Benchmark profiles: stated fractions, sampling that keeps them, bad profiles refused."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from bench.profiles import (
    PROFILES,
    STEP_SECONDS,
    AsyncSampler,
    Hold,
    Jitter,
    LogNormalTail,
    OffPhase,
    PhaseSpec,
    Profile,
    StepPhase,
    get_profile,
    sync_profile,
)

STATED = {
    "balanced": (
        0.40,
        {
            StepPhase.ROLLOUT: 0.60,
            StepPhase.LOGPROB: 0.07,
            StepPhase.TRAIN: 0.32,
            StepPhase.SYNC: 0.01,
        },
    ),
    "rollout-heavy": (0.40, {StepPhase.ROLLOUT: 0.84, StepPhase.TRAIN: 0.14, StepPhase.SYNC: 0.02}),
    "train-heavy": (
        0.55,
        {
            StepPhase.ROLLOUT: 0.49,
            StepPhase.LOGPROB: 0.07,
            StepPhase.TRAIN: 0.38,
            StepPhase.SYNC: 0.06,
        },
    ),
    "async": (0.42, {StepPhase.TRAIN: 0.92, StepPhase.SYNC: 0.08}),
    "long-tail": (
        0.40,
        {
            StepPhase.ROLLOUT: 0.60,
            StepPhase.LOGPROB: 0.07,
            StepPhase.TRAIN: 0.32,
            StepPhase.SYNC: 0.01,
        },
    ),
    "balanced-fixed": (
        0.40,
        {
            StepPhase.ROLLOUT: 0.60,
            StepPhase.LOGPROB: 0.07,
            StepPhase.TRAIN: 0.32,
            StepPhase.SYNC: 0.01,
        },
    ),
}


@pytest.mark.parametrize("name", sorted(STATED))
def test_builtin_profiles_have_the_stated_means(name: str) -> None:
    busy, fractions = STATED[name]
    profile = get_profile(name)
    assert profile.busy_fraction == pytest.approx(busy)
    assert profile.step_seconds == pytest.approx(STEP_SECONDS)
    got = profile.accelerator_fractions()
    assert got.keys() == fractions.keys()
    for phase, share in fractions.items():
        assert got[phase] == pytest.approx(share)
    assert profile.roles == ("main",)


@pytest.mark.parametrize("name", sorted(STATED))
def test_sampled_steps_keep_the_fractions(name: str) -> None:
    busy, fractions = STATED[name]
    profile = PROFILES[name]
    rng = random.Random(7)
    plans = [profile.sample_step(rng) for _ in range(3000)]
    accelerator = math.fsum(p.accelerator_seconds for p in plans)
    per_phase: dict[StepPhase, float] = {}
    for plan in plans:
        for phase, seconds in plan.phase_seconds().items():
            per_phase[phase] = per_phase.get(phase, 0.0) + seconds
    for phase, share in fractions.items():
        # Long tails converge slowly: 3000 draws of a p99 = 10x median tail stay within 5%.
        assert per_phase[phase] / accelerator == pytest.approx(share, rel=0.05, abs=0.003)
    if profile.sampler is None:
        total = accelerator + math.fsum(p.off_seconds for p in plans)
        assert accelerator / total == pytest.approx(busy, rel=0.03)
    else:
        batches = math.fsum(profile.sample_batch(rng) for _ in range(3000))
        assert accelerator / batches == pytest.approx(busy, rel=0.03)


def test_fixed_profile_draws_exactly_its_means() -> None:
    plan = PROFILES["balanced-fixed"].sample_step(random.Random(1))
    assert plan.accelerator_seconds == pytest.approx(40.0)
    assert plan.off_seconds == pytest.approx(60.0)


def test_the_same_seed_draws_the_same_steps() -> None:
    profile = PROFILES["long-tail"]
    a = [profile.sample_step(random.Random("1:x")) for _ in range(3)]
    b = [profile.sample_step(random.Random("1:x")) for _ in range(3)]
    assert a == b


def test_jitter_has_mean_one_and_the_requested_spread() -> None:
    rng = random.Random(3)
    draws = [Jitter(0.1).factor(rng) for _ in range(20000)]
    assert statistics.fmean(draws) == pytest.approx(1.0, abs=0.005)
    assert statistics.pstdev(draws) == pytest.approx(0.1, rel=0.05)
    assert Jitter(0).factor(rng) == 1.0


def test_log_normal_tail_has_mean_one_and_p99_ten_times_the_median() -> None:
    tail = LogNormalTail(10.0)
    assert math.exp(tail.sigma * 2.3263478740408408) == pytest.approx(10.0)
    rng = random.Random(5)
    draws = sorted(tail.factor(rng) for _ in range(40000))
    median = draws[len(draws) // 2]
    p99 = draws[int(0.99 * len(draws))]
    assert median == pytest.approx(tail.median, rel=0.05)
    assert p99 / median == pytest.approx(10.0, rel=0.12)
    assert statistics.fmean(draws) == pytest.approx(1.0, rel=0.05)


def test_async_profile_is_paced_by_its_samplers() -> None:
    profile = PROFILES["async"]
    assert profile.sampler == AsyncSampler(batch_seconds=STEP_SECONDS, staleness=1)
    assert profile.accelerator_seconds == pytest.approx(42.0)
    # The trainer trains faster than batches arrive, so a step lasts one batch.
    assert profile.step_seconds == pytest.approx(STEP_SECONDS)


@pytest.mark.parametrize(
    "build",
    [
        lambda: sync_profile("x", "x", {StepPhase.ROLLOUT: 0.5}, 0.4),  # fractions sum to 0.5
        lambda: sync_profile("x", "x", {StepPhase.ROLLOUT: 1.0}, 0.0),  # never busy
        lambda: sync_profile("x", "x", {StepPhase.ROLLOUT: 1.0}, 1.5),
        lambda: PhaseSpec(StepPhase.REWARD, 1.0),  # not an accelerator phase
        lambda: PhaseSpec(StepPhase.TRAIN, -1.0),
        lambda: OffPhase(1.0, phase=StepPhase.TRAIN),
        lambda: Hold(()),
        lambda: Profile("x", "x", (OffPhase(1.0),)),  # no hold
        lambda: Profile(
            "x",
            "x",
            (OffPhase(1.0), Hold((PhaseSpec(StepPhase.TRAIN, 1.0),))),
            sampler=AsyncSampler(1.0),
        ),
        lambda: AsyncSampler(0.0),
        lambda: AsyncSampler(1.0, staleness=-1),
        lambda: Jitter(-0.1),
        lambda: LogNormalTail(1.0),
    ],
)
def test_bad_profiles_are_refused(build: object) -> None:
    with pytest.raises(ValueError):
        build()  # type: ignore[operator]


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="balanced"):
        get_profile("nope")


def test_separate_groups_show_as_roles() -> None:
    profile = Profile(
        "split",
        "rollout and training on separate groups",
        (
            Hold((PhaseSpec(StepPhase.ROLLOUT, 30.0),), role="rollout"),
            OffPhase(40.0),
            Hold((PhaseSpec(StepPhase.TRAIN, 30.0),), role="train"),
        ),
    )
    assert profile.roles == ("rollout", "train")
    assert profile.busy_fraction == pytest.approx(0.6)
