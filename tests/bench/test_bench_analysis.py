"""Benchmark maths on known inputs: windows, duty, step times, switch splits, bounds, targets."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from bench._common import cpu_by_role, parse_metrics
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
from bench.controlplane import CyclesResult, FanoutResult, HandoffResult
from bench.profiles import StepPhase
from bench.report import check_targets, render_summary, switch_table, workload_table
from bench.run import _finite, output_name, same_code
from bench.workload import REFERENCE_COSTS, Baseline, RunResult, SimCosts, _cluster_kwargs
from timeslice_agent.journal import JournalEntry
from timeslice_tools.dev.timeline import Interval


def ph(
    job: str, phase: StepPhase, step: int, start: float, end: float, group: str = "g"
) -> PhaseSample:
    on_group = phase.on_accelerator or phase is StepPhase.QUEUE
    return PhaseSample(job, group if on_group else "", phase, step, start, end)


def grant(
    job: str,
    epoch: int,
    *,
    previous: str = "",
    restored: bool = True,
    switch: float = 0.0,
    asked: float = 0.0,
    granted: float = 0.0,
) -> GrantSample:
    return GrantSample(
        job, "g", 0, asked, granted, granted, epoch, epoch, restored, previous, switch, 0.0
    )


def entry(
    kind: str, job: str, epoch: int, node: str, start: float, end: float, status: str = "ok"
) -> JournalEntry:
    return JournalEntry(
        node, f"s{epoch}-{kind}-{node}", "g", epoch, kind, job, status, "", 0, start, end
    )


def test_stats_use_nearest_rank_percentiles() -> None:
    s = Stats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.n, s.p50, s.p99, s.mean, s.max) == (5, 3.0, 5.0, 3.0, 5.0)
    assert Stats.of(float(i) for i in range(1, 101)).p99 == 99.0
    assert Stats.of([0.5]).scaled(1000) == Stats(1, 500.0, 500.0, 500.0, 500.0)
    empty = Stats.of([])
    assert empty.n == 0 and math.isnan(empty.p50)


def test_duty_counts_overlaps_once_and_ignores_other_phases() -> None:
    samples = [
        ph("a", StepPhase.ROLLOUT, 0, 0.0, 4.0),
        ph("a", StepPhase.TRAIN, 0, 4.0, 5.0),
        ph("b", StepPhase.ROLLOUT, 0, 4.5, 6.0),  # overlaps a's train by 0.5
        ph("b", StepPhase.REWARD, 0, 6.0, 10.0),  # off the accelerators
        ph("b", StepPhase.QUEUE, 0, 2.0, 4.5),  # waiting is not busy
        ph("c", StepPhase.TRAIN, 0, 0.0, 10.0, group="other"),
    ]
    duty = duty_by_group(samples, Interval(0.0, 10.0))
    assert duty == {"g": pytest.approx(0.6), "other": pytest.approx(1.0)}


def test_active_window_is_when_every_job_is_past_warm_up() -> None:
    samples = [
        ph("a", StepPhase.REWARD, 0, 0.0, 1.0),
        ph("a", StepPhase.TRAIN, 0, 1.0, 2.0),
        ph("a", StepPhase.REWARD, 1, 2.0, 3.0),
        ph("a", StepPhase.TRAIN, 1, 3.0, 4.0),
        ph("a", StepPhase.REWARD, 2, 4.0, 5.0),
        ph("a", StepPhase.TRAIN, 2, 5.0, 6.0),
        ph("b", StepPhase.REWARD, 0, 0.5, 1.5),
        ph("b", StepPhase.TRAIN, 0, 1.5, 2.5),
        ph("b", StepPhase.REWARD, 1, 2.5, 3.5),
        ph("b", StepPhase.TRAIN, 1, 3.5, 4.5),
    ]
    assert active_window(samples, ["a", "b"], warmup=1) == Interval(2.5, 4.5)
    assert active_window(samples, ["a"], warmup=0) == Interval(0.0, 6.0)
    assert mean_step_seconds(samples, "a", warmup=1) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no step after"):
        active_window(samples, ["b"], warmup=2)
    late = [*samples, ph("c", StepPhase.TRAIN, 0, 7.0, 8.0), ph("c", StepPhase.TRAIN, 1, 8.0, 9.0)]
    with pytest.raises(ValueError, match="never ran together"):
        active_window(late, ["a", "c"], warmup=1)


def test_switch_split_takes_the_slowest_node_per_phase() -> None:
    journal = [
        # switch record epoch 10: a out, b in, on two nodes
        entry("checkpoint", "a", 10, "n0", 1.00, 1.03),
        entry("checkpoint", "a", 10, "n1", 1.00, 1.05),  # slowest checkpoint: 50 ms
        entry("restore", "b", 10, "n0", 1.06, 1.08),
        entry("restore", "b", 10, "n1", 1.06, 1.10),  # slowest restore: 40 ms
        # epoch 20 rolled back: b out, b back (its restore is b's, never a grant of a's)
        entry("checkpoint", "b", 20, "n0", 2.0, 2.1),
        entry("restore", "b", 20, "n0", 2.1, 2.2),
        entry("restore", "a", 30, "n0", 3.0, 3.01, status="refused"),  # not executed
        entry("checkpoint", "b", 40, "n0", 4.0, 4.02),
        entry("restore", "a", 40, "n0", 4.02, 4.05),
    ]
    grants = [
        grant("a", 5, previous="", switch=0.01),  # first grant: nothing was resident
        grant("b", 11, previous="a", switch=0.12),
        grant("a", 41, previous="b", switch=0.08),
        grant("a", 42, previous="", restored=False),  # in place
    ]
    splits = split_switches(grants, journal)
    assert [(s.epoch, s.switch_epoch, s.from_job, s.to_job) for s in splits] == [
        (11, 10, "a", "b"),
        (41, 40, "b", "a"),
    ]
    first, second = splits
    assert first.data == pytest.approx(0.09)
    assert first.control == pytest.approx(0.03)
    assert (first.start, first.end) == (1.00, 1.10)
    assert second.data == pytest.approx(0.05)
    assert second.control == pytest.approx(0.03)


@pytest.mark.parametrize(
    ("jobs", "busy", "sigma", "expected"),
    [
        (1, 0.4, 0.5, 0.4),  # alone: never switches
        (2, 0.4, 0.0, 0.8),  # free switches: min(1, N f)
        (3, 0.4, 0.0, 1.0),
        (2, 0.4, 0.016, 0.8 / 1.016),  # default sim costs, 100 s steps: unsaturated
        (3, 0.4, 0.016, 0.4 / 0.416),  # saturated: f / (f + sigma)
        (2, 0.4, 0.28, 0.4 / 0.68),  # reference costs: saturated
        (2, 0.55, 0.0, 1.0),
    ],
)
def test_analytic_duty_bound(jobs: int, busy: float, sigma: float, expected: float) -> None:
    assert analytic_duty_bound(jobs, busy, sigma) == pytest.approx(expected)


def test_analytic_bound_is_continuous_and_below_the_free_switch_bound() -> None:
    for jobs in (2, 3, 4):
        for sigma in (0.0, 0.01, 0.1, 0.5):
            bound = analytic_duty_bound(jobs, 0.4, sigma)
            assert bound <= min(1.0, jobs * 0.4) + 1e-12
            # The saturation point: N (f + sigma) = 1 + sigma; both branches agree there.
            sigma_star = (1 - jobs * 0.4) / (jobs - 1) if jobs * 0.4 < 1 else None
            if sigma_star is not None and sigma_star > 0:
                left = jobs * 0.4 / (1 + sigma_star)
                right = 0.4 / (0.4 + sigma_star)
                assert left == pytest.approx(right)
    with pytest.raises(ValueError):
        analytic_duty_bound(0, 0.4, 0.0)
    with pytest.raises(ValueError):
        analytic_duty_bound(2, 0.0, 0.0)
    with pytest.raises(ValueError):
        analytic_duty_bound(2, 0.4, -0.1)


def test_analytic_step_ratio() -> None:
    assert analytic_step_ratio(1, 0.4, 0.3) == 1.0
    assert analytic_step_ratio(2, 0.4, 0.016) == pytest.approx(1.016)
    assert analytic_step_ratio(3, 0.4, 0.016) == pytest.approx(3 * 0.416)


def test_sim_costs_model_the_switch() -> None:
    assert SimCosts().switch_seconds == pytest.approx(1.6)
    assert REFERENCE_COSTS.switch_seconds == pytest.approx(28.0)
    assert SimCosts.for_switch(0, "free").switch_seconds == 0.0
    args = SimCosts().agent_args(0.03)
    assert args[args.index("--sim-time-scale") + 1] == "0.03"
    free = SimCosts.for_switch(0, "free").agent_args(0.03)
    assert free[free.index("--sim-time-scale") + 1] == "0"
    with pytest.raises(ValueError):
        SimCosts(bandwidth_gbps=0)
    with pytest.raises(ValueError):
        SimCosts.for_switch(-1, "x")


def test_cluster_kwargs_put_the_callers_agent_args_last() -> None:
    kwargs = _cluster_kwargs(
        3,
        SimCosts(),
        0.5,
        {
            "replicas": 3,
            "agent_args": ["--sim-state-gb", "1"],
            "orchestrator_args": ["--x"],
        },
    )
    assert kwargs["agents"] == 3 and kwargs["replicas"] == 3
    assert kwargs["orchestrator_args"] == ["--x"]
    assert kwargs["agent_args"][-2:] == ["--sim-state-gb", "1"]
    assert "--sim-time-scale" in kwargs["agent_args"]


def _baseline(**changes: object) -> Baseline:
    base = Baseline("balanced", 4, 12, 1, 0.03, 1, [3.0] * 4, [0.4] * 4)
    return replace(base, **changes)  # type: ignore[arg-type]


def test_baseline_covers_only_matching_runs() -> None:
    from bench.profiles import PROFILES

    balanced = PROFILES["balanced"]
    assert _baseline().covers(balanced, 3, 12, 1, 0.03, 1)
    assert not _baseline().covers(balanced, 5, 12, 1, 0.03, 1)
    assert not _baseline().covers(balanced, 2, 10, 1, 0.03, 1)
    assert not _baseline().covers(balanced, 2, 12, 2, 0.03, 1)
    assert not _baseline().covers(balanced, 2, 12, 1, 0.02, 1)
    assert not _baseline().covers(PROFILES["async"], 2, 12, 1, 0.03, 1)


def _run(label: str, jobs: int, duty: float, slowdown: list[float]) -> RunResult:
    s = Stats.of([1.0])
    return RunResult(
        label=label,
        profile="balanced",
        jobs=jobs,
        nodes=2,
        replicas=1,
        time_scale=0.03,
        steps=12,
        seed=1,
        sim={},
        orchestrator_args=[],
        busy_fraction=0.4,
        step_seconds_real=100.0,
        switch_seconds_real=1.6,
        wall_seconds=1.0,
        window_seconds=1.0,
        duty={"balanced-main": duty},
        analytic_bound=0.787,
        analytic_bound_measured=0.78,
        analytic_step_ratio=1.016,
        model_duty=0.77,
        model_slowdown=[1.02] * jobs,
        model_long_duty=0.776,
        model_long_slowdown=[1.03] * jobs,
        baseline_step_seconds=[3.0] * jobs,
        shared_step_seconds=[3.0 * x for x in slowdown],
        slowdown=slowdown,
        steps_per_second=1.0,
        phases_per_second=4.0,
        switches=10,
        switch_wall_ms=s,
        switch_data_ms=s,
        switch_control_ms=s,
        queue_wait_ms=s,
        orchestrator_metrics={},
        violations=[],
        holds=[],
        switch_spans=[],
        baseline=_baseline(),
    )


def test_targets_are_judged_against_the_brief() -> None:
    fast = Stats(10, 3.0, 20.0, 4.0, 21.0)
    slow = Stats(10, 6.0, 30.0, 7.0, 31.0)
    runs = {
        "balanced-n2": _run("balanced-n2", 2, 0.785, [1.03, 1.049]),
        "balanced-n3": _run("balanced-n3", 3, 0.89, [1.2, 1.2, 1.2]),
        "balanced-n2-reference": _run("balanced-n2-reference", 2, 0.55, [1.4, 1.4]),
    }
    handoff = [
        HandoffResult(1, 10, fast, fast, fast, {}, []),
        HandoffResult(3, 10, slow, slow, slow, {}, []),
    ]
    cycles = [
        CyclesResult(100, 1, 16, 100, 5.0, 3000, 600.0, fast, {}, {}, []),
        CyclesResult(10, 1, 10, 10, 5.0, 100, 20.0, fast, {}, {}, []),
    ]
    fanout = [FanoutResult(4, 60, slow, fast, Stats(60, 25.0, 40.0, 26.0, 41.0), slow, {}, [])]
    verdicts = {t.name: t.met for t in check_targets(runs, handoff, cycles, fanout)}
    assert verdicts == {
        "balanced, 2 jobs, default sim costs": True,
        "balanced, 3 jobs, default sim costs": False,
        "balanced, 2 jobs, reference switch costs (21 s + 7 s)": None,
        "handoff latency, 1 replica": True,
        "handoff latency, 3 replicas": False,
        "switch control-plane overhead, 4-node group": False,
        "acquire/yield throughput, 100 groups, 1 replica": True,
    }
    # A slowdown over 5% misses even with the duty met.
    runs["balanced-n2"] = _run("balanced-n2", 2, 0.80, [1.06, 1.0])
    assert not check_targets(runs, [], [], [])[0].met


def test_summary_renders_every_section_and_labels_the_emulation() -> None:
    runs = {"balanced-n2": _run("balanced-n2", 2, 0.785, [1.03, 1.04])}
    text = render_summary(
        suite="quick",
        machine={"cpus": 2},
        time_scale=0.03,
        steps=12,
        runs=runs,
        baseline_duty={"balanced": 0.4},
        handoff=[],
        cycles=[],
        memory=None,
        fanout=[],
        profile=None,
        targets=check_targets(runs, [], [], []),
        figures=["x.png"],
        errors={"cycles g1 r1": "boom"},
        wall_seconds=60.0,
    )
    assert "emulated data movement" in text
    assert "| balanced-n2 | 2 | 1.6 s | 78.5% |" in text
    assert "boom" in text and "![x.png](x.png)" in text
    assert len(workload_table(list(runs.values()))) == 3
    assert len(switch_table(list(runs.values()))) == 3
    assert "ideal platform gets 77.0% and +2.0% on the same draws" in text


def test_suites_share_a_results_directory_without_clobbering() -> None:
    assert output_name("full", "summary.md") == "summary.md"
    assert output_name("full", "duty-vs-jobs.png") == "duty-vs-jobs.png"
    assert output_name("quick", "summary.md") == "summary-quick.md"
    assert output_name("quick", "duty-vs-jobs.png") == "quick-duty-vs-jobs.png"


def test_code_changes_are_told_apart_from_other_commits() -> None:
    a = "abc123 services:111 libs:222"
    assert same_code(a, "def456 services:111 libs:222")  # a docs or bench commit
    assert not same_code(a, "def456 services:333 libs:222")
    assert not same_code(a, "abc123 services:111 libs:222 dirty")
    assert same_code("unknown", "unknown")


def test_json_output_has_no_nan() -> None:
    data = _finite({"a": float("nan"), "b": [1.0, float("inf")], "c": (2, "x")})
    assert data == {"a": None, "b": [1.0, None], "c": [2, "x"]}
    json.dumps(data, allow_nan=False)


def test_metric_parsing_and_cpu_roles() -> None:
    text = (
        "# HELP timeslice_grants_total Grants made\n"
        'timeslice_grants_total{kind="switch"} 3.0\n'
        "timeslice_waiters 0.0\n"
        "garbage line here\n"
    )
    assert parse_metrics(text) == {
        'timeslice_grants_total{kind="switch"}': 3.0,
        "timeslice_waiters": 0.0,
    }
    roles = cpu_by_role(
        {"r0": 1.0, "r1": 1.0, "node-0": 0.5, "etcd": 2.0, "bench": 1.0},
        {"r0": 2.0, "r1": 1.5, "node-0": 0.75, "etcd": 2.5, "bench": 1.25},
    )
    assert roles == pytest.approx({"orchestrator": 1.5, "agents": 0.25, "etcd": 0.5, "bench": 0.25})
