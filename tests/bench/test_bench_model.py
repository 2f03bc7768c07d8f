"""The ideal-platform model: it must reproduce the analytic bound where the bound is exact."""

from __future__ import annotations

import pytest

from bench.analysis import analytic_duty_bound
from bench.model import simulate
from bench.profiles import PROFILES, Hold, PhaseSpec, Profile, StepPhase


@pytest.mark.parametrize(("jobs", "switch"), [(2, 0.0), (2, 1.6), (2, 28.0), (3, 1.6), (3, 10.0)])
def test_fixed_durations_reach_the_analytic_bound(jobs: int, switch: float) -> None:
    # Without jitter the jobs settle into perfect alternation: the bound is exact.
    out = simulate(PROFILES["balanced-fixed"], jobs, switch_seconds=switch, steps=200)
    bound = analytic_duty_bound(jobs, 0.4, switch / 100)
    assert out.duty == pytest.approx(bound, abs=0.005)
    assert out.switches > 0


def test_one_job_never_switches_and_never_slows_down() -> None:
    out = simulate(PROFILES["balanced-fixed"], 1, switch_seconds=5.0, steps=20)
    assert out.switches == 0
    assert out.slowdown == [pytest.approx(1.0)]
    assert out.duty == pytest.approx(0.4, abs=0.01)


def test_jitter_costs_duty_even_with_free_switches() -> None:
    fixed = simulate(PROFILES["balanced-fixed"], 2, switch_seconds=0.0, steps=300)
    jittered = simulate(PROFILES["balanced"], 2, switch_seconds=0.0, steps=300)
    assert fixed.duty == pytest.approx(0.8, abs=0.005)
    assert jittered.duty < fixed.duty - 0.01


def test_async_trainers_are_paced_by_their_batches() -> None:
    out = simulate(PROFILES["async"], 2, switch_seconds=1.6, steps=100)
    assert out.duty == pytest.approx(2 * 0.42, abs=0.03)
    assert all(s == pytest.approx(1.0, abs=0.03) for s in out.slowdown)


def test_the_model_is_deterministic_and_refuses_what_it_cannot_model() -> None:
    a = simulate(PROFILES["long-tail"], 2, switch_seconds=1.6, steps=12)
    assert a == simulate(PROFILES["long-tail"], 2, switch_seconds=1.6, steps=12)
    split = Profile(
        "split",
        "two groups",
        (
            Hold((PhaseSpec(StepPhase.ROLLOUT, 1.0),), role="a"),
            Hold((PhaseSpec(StepPhase.TRAIN, 1.0),), role="b"),
        ),
    )
    with pytest.raises(ValueError, match="one group"):
        simulate(split, 2, switch_seconds=0.0, steps=4)
    with pytest.raises(ValueError):
        simulate(PROFILES["balanced"], 2, switch_seconds=-1.0, steps=4)
