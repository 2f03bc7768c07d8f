"""The placement optimizer (timeslice.placement): constraints, determinism, re-placement."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timeslice.errors import InvalidArgument
from timeslice.placement import (
    DEFAULT_PROFILE,
    BlockedBy,
    Constraints,
    Decision,
    Demand,
    JobProfile,
    JobState,
    Mode,
    Slot,
    Source,
    forecast,
    place,
    place_exhaustive,
)

POOL = ("g0", "g1", "g2", "g3")


def prof(
    busy: float,
    period: float = 100.0,
    *,
    cv: float = 0.1,
    mode: Mode = Mode.SYNC,
    switch_seconds: float = 0.0,
    source: Source = Source.DECLARED,
    phase: float | None = None,
) -> JobProfile:
    return JobProfile(busy, period, cv, mode, switch_seconds, source, phase)


def new(job: str, busy: float) -> Demand:
    return Demand(Slot(job), prof(busy))


def test_infeasible_pool_gives_the_best_partial_plan_and_says_why() -> None:
    # Three 60% jobs, two groups, cap 0.9: no two fit together, one is left over.
    demands = [new("a", 0.6), new("b", 0.6), new("c", 0.6)]
    for placement in (place(POOL[:2], demands), place_exhaustive(POOL[:2], demands)):
        assert not placement.feasible
        assert [a.slot.job for a in placement.unplaced] == ["c"]  # ties: the slot order
        assert placement.mapping() == {Slot("a"): "g0", Slot("b"): "g1"}
        (left,) = placement.unplaced
        assert left.decision is Decision.UNPLACED
        assert [(b.group, b.why) for b in left.reason.blocked] == [
            ("g0", BlockedBy.OVER_CAP),
            ("g1", BlockedBy.OVER_CAP),
        ]
        assert left.reason.blocked[0].load == pytest.approx(1.2)
        assert str(left.reason) == (
            "unplaced: no group can take it (g0: load would be 120%; g1: load would be 120%)"
        )


def test_a_tight_pool_places_as_many_slots_as_any_plan_could() -> None:
    # Four 50% jobs and two 25% ones, four groups, cap 0.5: busiest first fills every group
    # with a 50% job and leaves both small ones out; the best plan leaves one 50% job out.
    demands = [new(f"big{i}", 0.5) for i in range(4)] + [new("s0", 0.25), new("s1", 0.25)]
    rules = Constraints(cap=0.5)
    placement = place(POOL, demands, rules)
    (left,) = placement.unplaced
    assert left.slot.job.startswith("big")
    assert placement.group_of(Slot("s0")) == placement.group_of(Slot("s1"))
    assert len(place_exhaustive(POOL, demands, rules).unplaced) == 1


def test_an_empty_pool_is_infeasible_not_an_error() -> None:
    placement = place((), [new("a", 0.3)])
    assert not placement.feasible
    assert "the pool has no group" in str(placement.unplaced[0].reason)


def test_ties_are_broken_the_same_way_whatever_the_input_order() -> None:
    demands = [new(f"j{i}", 0.3) for i in range(6)]
    results = set()
    for seed in range(5):
        shuffled = list(demands)
        random.Random(seed).shuffle(shuffled)
        results.add(tuple(sorted(place(POOL, shuffled).mapping().items())))
        results.add(tuple(sorted(place_exhaustive(POOL, shuffled).mapping().items())))
    (only,) = results
    # Identical jobs: the first groups of the pool are used, three per group (load 0.9).
    assert dict(only) == {
        Slot("j0"): "g0", Slot("j1"): "g0", Slot("j2"): "g0",
        Slot("j3"): "g1", Slot("j4"): "g1", Slot("j5"): "g1",
    }  # fmt: skip


def test_a_running_job_whose_profile_grew_is_kept_and_flagged_then_moved_at_its_restart_point() -> (
    None
):
    b = Demand(Slot("b"), prof(0.4), JobState.RUNNING, "g0")
    grown = prof(0.7, source=Source.MEASURED)
    running = place(POOL, [Demand(Slot("a"), grown, JobState.RUNNING, "g0"), b])
    kept = running.assignments[0]
    assert kept.group == "g0" and kept.decision is Decision.KEPT
    assert kept.reason.over_cap
    assert "over the cap: re-placed at its next restart point" in str(kept.reason)
    assert running.assignments[1].group == "g0"
    # At its restart point the same job moves off the overloaded group; b keeps running.
    restarted = place(POOL, [Demand(Slot("a"), grown, JobState.AT_RESTART_POINT, "g0"), b])
    moved = restarted.assignments[0]
    assert moved.decision is Decision.MOVED and moved.group != "g0"
    assert moved.reason.previous_group == "g0"
    assert str(moved.reason).startswith(f"moved from g0 to {moved.group}: alone; measured")
    assert restarted.group_of(Slot("b")) == "g0"


def test_a_job_at_its_restart_point_stays_unless_moving_gains_enough() -> None:
    # a alone on g1 could join b on g0 (both 40%): a real gain, so it moves.
    b = Demand(Slot("b"), prof(0.4), JobState.RUNNING, "g0")
    a = Demand(Slot("a"), prof(0.4), JobState.AT_RESTART_POINT, "g1")
    assert place(POOL, [a, b]).group_of(Slot("a")) == "g0"
    # Already paired: nothing better exists, it stays where it is.
    a_home = Demand(Slot("a"), prof(0.4), JobState.AT_RESTART_POINT, "g0")
    stayed = place(POOL, [a_home, b]).assignments[0]
    assert stayed.decision is Decision.STAYED and stayed.group == "g0"
    # With a high bar for moving, the lone job stays alone.
    lazy = place(POOL, [a, b], Constraints(min_gain=0.5))
    assert lazy.group_of(Slot("a")) == "g1"


def test_pins_exclusions_and_drained_groups_are_respected() -> None:
    demands = [new("a", 0.4), new("b", 0.4), new("c", 0.4), new("d", 0.4)]
    free = place(POOL, demands)
    assert len(free.groups) == 2  # two pairs
    rules = Constraints(
        pins={Slot("d"): "g3"},
        excluded=frozenset({frozenset({"a", "b"}), frozenset({"a", "c"})}),
        drained=frozenset({"g0"}),
    )
    placement = place(POOL, demands, rules)
    got = placement.mapping()
    assert got[Slot("d")] == "g3"
    assert placement.assignments[3].decision is Decision.PINNED
    assert "g0" not in got.values()
    assert got[Slot("a")] not in (got[Slot("b")], got[Slot("c")])
    assert got[Slot("a")] == "g3"  # the only partner a may have is d
    assert got == place_exhaustive(POOL, demands, rules).mapping()
    # A running job on a drained group stays; nothing new joins it.
    running = Demand(Slot("r"), prof(0.2), JobState.RUNNING, "g0")
    drained = place(POOL, [running, new("e", 0.2)], Constraints(drained=frozenset({"g0"})))
    assert drained.mapping() == {Slot("r"): "g0", Slot("e"): "g1"}
    blocked = place(("g0",), [running, new("e", 0.2)], Constraints(drained=frozenset({"g0"})))
    assert [b.why for b in blocked.unplaced[0].reason.blocked] == [BlockedBy.DRAINED]


def test_an_excluded_pair_is_named_when_it_leaves_a_job_unplaced() -> None:
    rules = Constraints(excluded=frozenset({frozenset({"a", "b"})}))
    placement = place(("g0",), [new("a", 0.3), new("b", 0.2)], rules)
    (left,) = placement.unplaced
    assert left.slot == Slot("b")
    assert str(left.reason) == "unplaced: no group can take it (g0: excluded with a)"


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Demand], Constraints]:
    n = draw(st.integers(1, 7))
    demands = []
    for i in range(n):
        state = draw(st.sampled_from(list(JobState)))
        demands.append(
            Demand(
                Slot(f"j{i}", draw(st.sampled_from(["main", "sampler"]))),
                prof(
                    draw(st.floats(0.05, 0.95)),
                    draw(st.sampled_from([50.0, 100.0])),
                    cv=draw(st.floats(0, 1)),
                    mode=draw(st.sampled_from(list(Mode))),
                    switch_seconds=draw(st.floats(0, 5)),
                ),
                state,
                None if state is JobState.NEW else draw(st.sampled_from(POOL)),
            )
        )
    drained = frozenset(draw(st.lists(st.sampled_from(POOL), max_size=2)))
    return demands, Constraints(cap=draw(st.floats(0.5, 1.0)), drained=drained)


@settings(max_examples=80, deadline=None)
@given(scenarios())
def test_running_jobs_never_move_and_every_placed_group_respects_the_rules(
    scenario: tuple[list[Demand], Constraints],
) -> None:
    demands, rules = scenario
    for placement in (place(POOL, demands, rules), place_exhaustive(POOL, demands, rules)):
        by_slot = {a.slot: a for a in placement.assignments}
        assert list(by_slot) == [d.slot for d in demands]
        for d in demands:
            got = by_slot[d.slot]
            if d.state is JobState.RUNNING:
                assert got.group == d.group and got.decision is Decision.KEPT
            elif got.group is not None and got.group != d.group:
                assert got.group not in rules.drained
        for g in placement.groups:
            running = {d.slot for d in demands if d.state is JobState.RUNNING}
            if len(g.members) > 1 and not set(g.members) <= running:
                assert g.load <= rules.cap + 1e-9
    # The heuristic places as many slots as the exhaustive search.
    assert len(place(POOL, demands, rules).unplaced) == len(
        place_exhaustive(POOL, demands, rules).unplaced
    )


def test_the_heuristic_comes_close_to_the_exhaustive_search() -> None:
    # Issue 40's targets, on predicted figures: >= 0.95 of the best duty on every instance,
    # the worst slowdown within 5 points on average (one instance here is 17 points off: a
    # plan 3 slots away from the heuristic's: two leave one group, one enters it).
    rng = random.Random(7)
    gaps = []
    for _ in range(25):
        demands = [
            Demand(
                Slot(f"j{i}"),
                prof(
                    rng.uniform(0.2, 0.6),
                    rng.choice([60.0, 100.0, 150.0]),
                    cv=rng.choice([0.05, 0.1, 0.25]),
                    mode=rng.choice(list(Mode)),
                    switch_seconds=rng.choice([1.6, 4.0]),
                ),
            )
            for i in range(rng.randint(4, 7))
        ]
        ours = place(POOL, demands)
        best = place_exhaustive(POOL, demands)
        assert best.exhaustive and not ours.exhaustive
        assert ours.duty >= 0.95 * best.duty
        assert len(ours.groups) == len(best.groups)
        gaps.append(ours.worst_slowdown - best.worst_slowdown)
    assert sum(gaps) / len(gaps) <= 0.05
    assert max(gaps) <= 0.2


def test_two_half_busy_jobs_in_antiphase_pair_better_than_in_phase() -> None:
    def half(phase: float) -> JobProfile:
        return prof(0.5, cv=0.02, phase=phase, source=Source.MEASURED)

    _, in_phase, slow_in = forecast([half(0.0), half(0.0)])
    _, anti, slow_anti = forecast([half(0.0), half(0.5)])
    assert anti > in_phase and max(slow_anti) < max(slow_in)
    assert anti == pytest.approx(1.0, abs=0.01)
    demands = [
        Demand(Slot("a"), half(0.0)),
        Demand(Slot("b"), half(0.02)),
        Demand(Slot("c"), half(0.5)),
        Demand(Slot("d"), half(0.52)),
    ]
    rules = Constraints(cap=1.0)
    for placement in (place(POOL, demands, rules), place_exhaustive(POOL, demands, rules)):
        got = placement.mapping()
        assert got[Slot("a")] == got[Slot("c")] and got[Slot("b")] == got[Slot("d")]
        assert got[Slot("a")] != got[Slot("b")]


def test_jittery_or_mismatched_periods_collide_more_than_a_locked_pair() -> None:
    _, locked, _ = forecast([prof(0.4, cv=0.05), prof(0.4, cv=0.05)])
    _, jittery, _ = forecast([prof(0.4, cv=0.5), prof(0.4, cv=0.5)])
    _, mismatched, _ = forecast([prof(0.4, 60.0, cv=0.05), prof(0.4, 150.0, cv=0.05)])
    assert locked > mismatched and locked > jittery
    # Switches count against sharing: the same pair with 10 s switches does less.
    _, switching, slow = forecast(
        [prof(0.4, cv=0.05, switch_seconds=10), prof(0.4, cv=0.05, switch_seconds=10)]
    )
    assert switching < locked and min(slow) >= 1.1
    # An async trainer absorbs a wait up to part of its slack; a sync job cannot.
    _, _, (sync_slow, _) = forecast([prof(0.4, cv=0.3), prof(0.4, 60.0, cv=0.3)])
    _, _, (async_slow, _) = forecast([prof(0.4, cv=0.3, mode=Mode.ASYNC), prof(0.4, 60.0, cv=0.3)])
    assert async_slow < sync_slow


def test_a_saturated_group_is_capped_at_its_whole_time() -> None:
    _, duty, slow = forecast([prof(0.6, cv=0.5), prof(0.6, 70.0, cv=0.5), prof(0.6, 40.0)])
    # They ask for 180% of the group's time: it serves all of it, and they slow down.
    assert duty == pytest.approx(1.0)
    assert sum(0.6 / x for x in slow) == pytest.approx(1.0) and max(slow) >= 1.8


def test_a_measured_profile_reads_busy_period_variation_and_phase() -> None:
    # Holds of 30 s every 100 s starting at 25 s past each hundred.
    holds = [(25.0 + 100 * k, 55.0 + 100 * k) for k in range(6)]
    p = JobProfile.measured(holds, switch_seconds=2.0)
    assert p.source is Source.MEASURED
    assert p.busy == pytest.approx(0.3)
    assert p.period_seconds == pytest.approx(100.0)
    assert p.cv == pytest.approx(0.0, abs=1e-9)
    assert p.phase == pytest.approx(0.25)
    assert p.switch_seconds == 2.0
    jittered = JobProfile.measured([(0.0, 10.0), (80.0, 120.0), (200.0, 210.0), (300.0, 330.0)])
    assert jittered.cv > 0.3
    with pytest.raises(InvalidArgument, match=">= 3 holds"):
        JobProfile.measured(holds[:2])


def test_a_job_without_a_profile_is_placed_conservatively() -> None:
    # The default assumes a busy, irregular job: it is not packed with a 40% one under 0.9.
    placement = place(POOL, [Demand(Slot("x"), DEFAULT_PROFILE), new("y", 0.4)])
    assert placement.group_of(Slot("x")) != placement.group_of(Slot("y"))
    assert "default profile" in str(placement.assignments[0].reason)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: prof(0.0), "busy must be within"),
        (lambda: prof(0.5, 0.0), "period_seconds must be > 0"),
        (lambda: prof(0.5, phase=1.0), "phase must be within"),
        (lambda: Constraints(cap=1.5), "cap must be within"),
        (lambda: Constraints(excluded=frozenset({frozenset({"a"})})), "names two jobs"),
        (lambda: place(POOL, [new("a", 0.3), new("a", 0.2)]), "demanded twice"),
        (lambda: place(("g", "g"), [new("a", 0.3)]), "names a group twice"),
        (
            lambda: place(POOL, [Demand(Slot("a"), prof(0.3), JobState.RUNNING)]),
            "names no group",
        ),
        (
            lambda: place(POOL, [Demand(Slot("a"), prof(0.3), JobState.RUNNING, "elsewhere")]),
            "not in the pool",
        ),
        (
            lambda: place(POOL, [new("a", 0.3)], Constraints(pins={Slot("a"): "nowhere"})),
            "pinned to nowhere",
        ),
        (
            lambda: place_exhaustive(POOL, [new(f"j{i}", 0.1) for i in range(13)]),
            "more than the exhaustive",
        ),
    ],
)
def test_bad_input_is_a_typed_error_naming_the_field(call: object, message: str) -> None:
    assert callable(call)
    with pytest.raises(InvalidArgument, match=message):
        call()
