"""The Placement service's pure parts: measured profiles from the usage ledger, the plan of one
Place over a pool's recorded state, and the operators' rules."""

from __future__ import annotations

import dataclasses

import pytest

from timeslice.errors import InvalidArgument
from timeslice.placement import Decision, Source
from timeslice_orchestrator.pool_plans import (
    MEASURED_CV,
    MIN_HOLDS,
    claims_of,
    measured_profile,
    plan_place,
    rule_change,
    validate_claim,
)
from timeslice_orchestrator.store.pools import PoolState
from timeslice_orchestrator.store.records import (
    DeclaredProfile,
    JobUsageRecord,
    PoolAssignmentsRecord,
    PoolAuditRecord,
    PoolRecord,
    RoleAssignment,
    UsageRecord,
)
from timeslice_orchestrator.visibility import OTHER_JOB
from timeslice_proto.timeslice.placement.v1 import GroupClaim, RuleKind, UpdatePoolRequest

DECLARED = DeclaredProfile(0.2, 1.0, 0.5, "sync", 0.0, "declared")


def _assigned(group: str, *, placed_at: float = 100.0, holds: int = 0) -> RoleAssignment:
    return RoleAssignment(
        group, "placed", "", DECLARED, placed_at, "r0", held_seconds=holds * 0.1, holds=holds,
        last_seen=placed_at - 1 if holds else 0.0,
    )  # fmt: skip


def test_measured_from_the_holds_since_the_placement() -> None:
    a = _assigned("g1", placed_at=100.0)
    # Too few holds: still the declared profile.
    few = JobUsageRecord(held_seconds=1.0, holds=MIN_HOLDS - 1, first_seen=101.0, last_seen=104)
    assert measured_profile(a, few).source is Source.DECLARED
    assert measured_profile(a, None).busy == 0.2
    # 5 holds of 0.6 s, one every second, the first granted at 101 (start-up left out).
    usage = JobUsageRecord(held_seconds=3.0, holds=5, first_seen=101.0, last_seen=105.6)
    p = measured_profile(a, usage)
    assert p.source is Source.MEASURED
    assert p.period_seconds == pytest.approx(1.0)
    assert p.busy == pytest.approx(0.6)
    # A job re-placed on a group it used before: only the holds since count.
    again = _assigned("g1", placed_at=200.0, holds=10)
    later = JobUsageRecord(held_seconds=1.0 + 4 * 0.5, holds=14, first_seen=50.0, last_seen=202.0)
    p = measured_profile(again, later)
    assert p.period_seconds == pytest.approx(0.5) and p.busy == pytest.approx(1.0)


def _ledger(holds: list[tuple[float, float]], session: str = "s1") -> JobUsageRecord:
    """The group's ledger for job ``j`` after these holds (of one session), as releases
    write it."""
    ledger = UsageRecord()
    for granted, released in holds:
        ledger.add("j", granted, released, session)
    return ledger.jobs["j"]


def test_the_variation_is_measured_from_the_ledgers_phase_sums() -> None:
    a = _assigned("g1", placed_at=100.0)
    steady = [(101.0 + i, 101.6 + i) for i in range(8)]
    assert measured_profile(a, _ledger(steady)).cv == pytest.approx(0.0, abs=1e-6)
    # Holds of 0.2 s and 1.0 s in turn, granted every 2 s: hold lengths vary by 2/3.
    jittery = [(101.0 + 2 * i, 101.0 + 2 * i + (0.2 if i % 2 else 1.0)) for i in range(8)]
    profile = measured_profile(a, _ledger(jittery))
    assert profile.source is Source.MEASURED
    assert profile.cv == pytest.approx(0.4 / 0.6, rel=1e-3)
    # Grants that come at uneven intervals (1 s, 3 s, ...) with steady holds: the intervals'.
    uneven = [(start, start + 0.5) for start in (101.0, 102.0, 105.0, 106.0, 109.0, 110.0)]
    assert measured_profile(a, _ledger(uneven)).cv == pytest.approx(0.96**0.5 / 1.8, rel=1e-6)


def test_only_the_samples_since_the_placement_count_for_the_variation() -> None:
    before = [(10.0 + 2 * i, 10.0 + 2 * i + (0.2 if i % 2 else 1.0)) for i in range(6)]
    seen = _ledger(before)
    a = _assigned("g1", placed_at=30.0, holds=seen.holds)
    a = dataclasses.replace(
        a,
        held_seconds=seen.held_seconds,
        last_seen=seen.last_seen,
        held_sq=seen.held_sq,
        periods=seen.periods,
        period_sum=seen.period_sum,
        period_sq=seen.period_sq,
    )
    ledger = UsageRecord(jobs={"j": seen})
    for i in range(6):  # steady since the placement, in the job's new session (a restart)
        ledger.add("j", 40.0 + i, 40.5 + i, "s2")
    # The restart's gap (20 s) is no period: the holds and intervals since are steady.
    assert measured_profile(a, ledger.jobs["j"]).cv == pytest.approx(0.0, abs=1e-6)
    # A ledger without phase sums (rewritten by the version before them): the default.
    old = JobUsageRecord(held_seconds=3.0, holds=5, first_seen=101.0, last_seen=105.6)
    assert measured_profile(_assigned("g1", placed_at=100.0), old).cv == MEASURED_CV


def _state(**jobs: dict[str, RoleAssignment]) -> PoolState:
    config = PoolRecord(groups=["g1", "g2"], cap=0.5, created_at=0.0)
    return PoolState("p", config, PoolAssignmentsRecord(dict(jobs)), PoolAuditRecord())


def test_a_running_job_keeps_its_group_and_nothing_is_written() -> None:
    heavy = JobUsageRecord(held_seconds=4.0, holds=5, first_seen=101.0, last_seen=106.0)
    state = _state(a={"s": _assigned("g1")}, b={"s": _assigned("g1")})

    def usage(group: str, job: str) -> JobUsageRecord | None:
        return heavy if (group, job) == ("g1", "a") else None

    change, results = plan_place(
        state, "a", ["s"], {}, usage=usage, running=True, replica="r0", now=300.0
    )
    assert [(r.group, r.decision) for r in results] == [("g1", Decision.KEPT)]
    assert change.empty
    # The same job at its restart point moves off the group b keeps (over the cap).
    change, results = plan_place(
        state, "a", ["s"], {}, usage=usage, running=False, replica="r0", now=300.0
    )
    assert [(r.group, r.decision, r.previous_group) for r in results] == [
        ("g2", Decision.MOVED, "g1")
    ]
    assert change.assignments is not None
    moved = change.assignments.jobs["a"]["s"]
    assert (moved.group, moved.holds, moved.placed_at) == ("g2", 0, 300.0)
    assert change.assignments.jobs["b"] == state.assignments.jobs["b"]
    assert [(e.what, e.job, e.group, e.previous_group) for e in change.audit] == [
        ("moved", "a", "g2", "g1")
    ]


def test_a_new_role_without_a_profile_is_placed_provisionally() -> None:
    change, results = plan_place(
        _state(), "n", ["main"], {}, usage=lambda g, j: None, running=False, replica="r", now=1.0
    )
    (r,) = results
    assert r.decision is Decision.PLACED and r.provisional and r.source is Source.DEFAULT
    assert change.assignments is not None and "n" in change.assignments.jobs


def test_rules_are_checked_and_applied() -> None:
    config = PoolRecord(groups=["g1", "g2"], cap=0.9, created_at=0.0)
    pinned = rule_change(config, UpdatePoolRequest("p", RuleKind.PIN, "a", "s", "g2"))
    assert [(p.job, p.role, p.group) for p in pinned.pins] == [("a", "s", "g2")]
    assert rule_change(pinned, UpdatePoolRequest("p", RuleKind.UNPIN, "a", "s")).pins == []
    excluded = rule_change(config, UpdatePoolRequest("p", RuleKind.EXCLUDE, "b", other_job_id="a"))
    assert excluded.excluded == [["a", "b"]]
    drained = rule_change(config, UpdatePoolRequest("p", RuleKind.DRAIN, group_id="g1"))
    assert drained.drained == ["g1"]
    for bad in (
        UpdatePoolRequest("p", RuleKind.PIN, "a", "s", "elsewhere"),
        UpdatePoolRequest("p", RuleKind.EXCLUDE, "a", other_job_id="a"),
        UpdatePoolRequest("p", RuleKind.DRAIN, group_id="../x"),
        UpdatePoolRequest("p", RuleKind.UNSPECIFIED),
    ):
        with pytest.raises(InvalidArgument):
            rule_change(config, bad)
    assert config.pins == [] and config.drained == []  # nothing changed in place


def test_a_job_reads_no_other_jobs_id_in_its_reasons() -> None:
    state = _state(b={"s": _assigned("g1")})
    _, (r,) = plan_place(
        state, "a", ["s"], {"s": DECLARED}, usage=lambda g, j: None, running=False,
        replica="r", now=1.0,
    )  # fmt: skip
    assert "with b/s" in r.reason
    assert "b/s" not in r.own_reason and f"with {OTHER_JOB}/s" in r.own_reason


def test_place_answers_the_claim_of_the_group_it_chose() -> None:
    state = _state()
    state.config.claims = {"g1": "gpus-a", "g2": "gpus-b"}
    _, results = plan_place(
        state, "n", ["s", "t"], {"s": DECLARED, "t": DECLARED}, usage=lambda g, j: None,
        running=False, replica="r", now=1.0,
    )  # fmt: skip
    assert {r.group for r in results} <= {"g1", "g2"} and results
    assert all(r.claim == state.config.claims[r.group] for r in results)
    # A group without a claim answers none.
    state.config.claims = {}
    _, (r,) = plan_place(
        state, "m", ["s"], {}, usage=lambda g, j: None, running=False, replica="r", now=1.0
    )
    assert r.group and r.claim == ""


def test_claims_are_kubernetes_names_one_per_group() -> None:
    for good in ("gpus-a", "trainer-pool", "a", "gpus.node-0", "x" * 63 + ".b"):
        assert validate_claim(good, "claim") == good
    for bad in ("", "Gpus", "-a", "a-", "a_b", "a..b", ".a", "x" * 64, "a/b", "a b"):
        with pytest.raises(InvalidArgument, match="claim"):
            validate_claim(bad, "claim")
    groups = ["g1", "g2"]
    claims = [GroupClaim("g1", "gpus-a"), GroupClaim("g2", "gpus-b")]
    assert claims_of(groups, claims) == {"g1": "gpus-a", "g2": "gpus-b"}
    for bad_claims, field in (
        ([GroupClaim("g3", "gpus-a")], r"claims\[0\]\.group_id"),  # not in the pool
        ([GroupClaim("g1", "a"), GroupClaim("g1", "b")], r"claims\[1\]\.group_id"),  # twice
        ([GroupClaim("g1", "a"), GroupClaim("g2", "a")], "one ResourceClaim per group"),
        ([GroupClaim("g1", "Not_A_Name")], r"claims\[0\]\.claim"),
    ):
        with pytest.raises(InvalidArgument, match=field):
            claims_of(groups, bad_claims)


def test_a_claim_is_set_and_unset_by_a_rule_and_survives_other_rules() -> None:
    config = PoolRecord(groups=["g1", "g2"], cap=0.9, created_at=0.0)
    claimed = rule_change(config, UpdatePoolRequest("p", RuleKind.CLAIM, group_id="g2", claim="c2"))
    assert claimed.claims == {"g2": "c2"}
    drained = rule_change(claimed, UpdatePoolRequest("p", RuleKind.DRAIN, group_id="g1"))
    assert drained.claims == {"g2": "c2"}
    # Round trip through etcd's encoding, and a record written before claims existed.
    assert PoolRecord.decode(drained.encode()).claims == {"g2": "c2"}
    older = b'{"groups":["g1"],"cap":0.9,"created_at":0.0,"pins":[],"excluded":[],"drained":[]}'
    assert PoolRecord.decode(older).claims == {}
    newer = older[:-1] + b',"from_a_newer_version":1}'
    assert PoolRecord.decode(newer).groups == ["g1"]
    for bad in (
        UpdatePoolRequest("p", RuleKind.CLAIM, group_id="g1", claim="Bad_Name"),
        UpdatePoolRequest("p", RuleKind.CLAIM, group_id="g1", claim=""),
        UpdatePoolRequest("p", RuleKind.CLAIM, group_id="g1", claim="c2"),  # g2's already
        UpdatePoolRequest("p", RuleKind.CLAIM, group_id="elsewhere", claim="c3"),
    ):
        with pytest.raises(InvalidArgument):
            rule_change(claimed, bad)
    assert claimed.claims == {"g2": "c2"}  # nothing changed in place
    unclaimed = rule_change(claimed, UpdatePoolRequest("p", RuleKind.UNCLAIM, group_id="g2"))
    assert unclaimed.claims == {}
