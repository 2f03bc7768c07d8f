"""The Markdown summary of a suite and the check of each target (pure, no I/O)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bench._common import SIM_LABEL, machine_line
from bench.analysis import Stats
from bench.controlplane import CyclesResult, FanoutResult, HandoffResult, MemoryResult
from bench.controlplane import ProfileResult as OrchestratorProfile
from bench.workload import RunResult

__all__ = ["TargetCheck", "check_targets", "render_summary"]

REFERENCE_DUTY = 0.87
# Runs without agents have no journals: their holds are checked, fencing and two-phase are not.
_HOLDS_ONLY = "invariants (holds; fencing, two-phase: not checked, no agents)"


@dataclass(frozen=True)
class TargetCheck:
    """One target of the brief: what it asks, what was measured, whether it is met."""

    name: str
    target: str
    measured: str
    met: bool | None  # None: reported for comparison, no pass/fail
    note: str = ""

    @property
    def verdict(self) -> str:
        return {True: "met", False: "MISSED", None: "reported"}[self.met]


def _pct(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1%}"


def _ms(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.1f} ms"


def check_targets(
    runs: dict[str, RunResult],
    handoff: Sequence[HandoffResult],
    cycles: Sequence[CyclesResult],
    fanout: Sequence[FanoutResult],
) -> list[TargetCheck]:
    """Each target of docs/benchmarks.md against what this suite measured (absent: skipped)."""
    out: list[TargetCheck] = []
    two = runs.get("balanced-n2")
    if two is not None:
        slow = two.max_slowdown - 1
        out.append(
            TargetCheck(
                "balanced, 2 jobs, default sim costs",
                "duty >= 78% (bound 80%), slowdown <= 5%",
                f"duty {_pct(two.main_duty)} (bound {_pct(two.analytic_bound)}), "
                f"worst slowdown {slow:+.1%}",
                two.main_duty >= 0.78 and slow <= 0.05,
                f"an ideal platform gets {_pct(two.model_duty)} and "
                f"{max(two.model_slowdown) - 1:+.1%} on the same draws, "
                f"{_pct(two.model_long_duty)} and {max(two.model_long_slowdown) - 1:+.1%} "
                "over 400 steps",
            )
        )
    three = runs.get("balanced-n3")
    if three is not None:
        out.append(
            TargetCheck(
                "balanced, 3 jobs, default sim costs",
                "duty >= 90%",
                f"duty {_pct(three.main_duty)} (bound {_pct(three.analytic_bound)})",
                three.main_duty >= 0.90,
                f"ideal platform, same draws: {_pct(three.model_duty)}",
            )
        )
    for n in (2, 3):
        ref = runs.get(f"balanced-n{n}-reference")
        if ref is not None:
            out.append(
                TargetCheck(
                    f"balanced, {n} jobs, reference switch costs (21 s + 7 s)",
                    f"report next to the reference's {REFERENCE_DUTY:.0%}",
                    f"duty {_pct(ref.main_duty)} (bound {_pct(ref.analytic_bound)})",
                    None,
                    "the reference's 87% is for its own jobs and step length; see the bound",
                )
            )
    for h in handoff:
        out.append(
            TargetCheck(
                f"handoff latency, {h.replicas} replica{'s' if h.replicas > 1 else ''}",
                "p50 <= 5 ms, p99 <= 25 ms",
                f"p50 {_ms(h.handoff_ms.p50)}, p99 {_ms(h.handoff_ms.p99)}",
                h.handoff_ms.p50 <= 5 and h.handoff_ms.p99 <= 25,
            )
        )
    for f in fanout:
        if f.nodes == 4:
            out.append(
                TargetCheck(
                    "switch control-plane overhead, 4-node group",
                    "p50 <= 20 ms",
                    f"p50 {_ms(f.control_ms.p50)}, p99 {_ms(f.control_ms.p99)}",
                    f.control_ms.p50 <= 20,
                )
            )
    for c in cycles:
        if c.groups == 100:
            out.append(
                TargetCheck(
                    f"acquire/yield throughput, 100 groups, {c.replicas} "
                    f"replica{'s' if c.replicas > 1 else ''}",
                    ">= 500 cycles/s",
                    f"{c.cycles_per_second:.0f} cycles/s",
                    c.cycles_per_second >= 500,
                )
            )
    return out


def _stats_cells(s: Stats) -> str:
    return f"{s.p50:.1f} / {s.p99:.1f}" if s.n else "n/a"


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _slowdowns(values: Sequence[float]) -> str:
    return " / ".join("n/a" if math.isnan(v) else f"{v - 1:+.1%}" for v in values)


def workload_table(runs: Sequence[RunResult]) -> list[str]:
    """Duty and slowdown per run, next to the ideal platform and the analytic bound."""
    rows = [
        [
            r.label,
            r.jobs,
            f"{r.switch_seconds_real:g} s",
            _pct(r.main_duty),
            _pct(r.model_duty),
            _pct(r.model_long_duty),
            _pct(r.analytic_bound),
            _pct(r.analytic_bound_measured),
            _slowdowns(r.slowdown),
            _slowdowns(r.model_slowdown),
            _slowdowns(r.model_long_slowdown),
            f"{r.analytic_step_ratio - 1:+.1%}",
            "ok" if r.ok else "VIOLATION",
        ]
        for r in runs
    ]
    return _table(
        [
            "run",
            "jobs",
            "switch (real)",
            "duty",
            "ideal, same draws",
            "ideal, long run",
            "bound",
            "bound (measured switch)",
            "slowdown per job",
            "ideal slowdown, same draws",
            "ideal slowdown, long run",
            "least slowdown (bound)",
            "invariants",
        ],
        rows,
    )


def switch_table(runs: Sequence[RunResult]) -> list[str]:
    """Switches per run: wall time split into data movement and control plane; waits."""
    rows = [
        [
            r.label,
            r.switches,
            _stats_cells(r.switch_wall_ms),
            _stats_cells(r.switch_data_ms),
            _stats_cells(r.switch_control_ms),
            _stats_cells(r.queue_wait_ms),
            f"{r.phases_per_second:.2f}",
            f"{r.steps_per_second:.2f}",
        ]
        for r in runs
    ]
    return _table(
        [
            "run",
            "switches",
            "switch wall p50/p99 ms",
            "data p50/p99 ms",
            "control p50/p99 ms",
            "queue wait p50/p99 ms",
            "acc. phases/s",
            "holds/s",
        ],
        rows,
    )


def render_summary(
    *,
    suite: str,
    machine: dict[str, Any],
    time_scale: float,
    steps: int,
    runs: dict[str, RunResult],
    baseline_duty: dict[str, float],
    handoff: Sequence[HandoffResult],
    cycles: Sequence[CyclesResult],
    memory: MemoryResult | None,
    fanout: Sequence[FanoutResult],
    profile: OrchestratorProfile | None,
    targets: Sequence[TargetCheck],
    figures: Sequence[str],
    errors: dict[str, str],
    wall_seconds: float,
) -> str:
    """The suite's ``summary.md``."""
    lines = [
        f"# timeslice benchmarks: suite `{suite}`",
        "",
        f"{machine_line(machine)}; suite wall time {wall_seconds / 60:.1f} min.",
        "",
        f"**All data movement is emulated ({SIM_LABEL}).** Workload runs use time scale "
        f"{time_scale:g} (1 bench second = {1 / time_scale:g} real seconds) for phases and "
        f"modelled transfers alike; {steps} steps per job, the first left out (warm-up). "
        "The control plane is not scaled, so it weighs more here than in a real run. "
        "Method and meaning of every number: docs/benchmarks.md.",
        "",
    ]
    end = machine.get("commit_at_end")
    if end is not None and not machine.get("same_code", True):
        lines += [
            f"**Warning: the code changed during the suite ({machine.get('commit')} at the "
            f"start, {end} at the end); benchmarks started after the change ran the new code.**",
            "",
        ]
    if errors:
        lines += ["## Errors", ""]
        lines += [f"- `{k}`: {v}" for k, v in errors.items()]
        lines.append("")
    lines += ["## Targets", ""]
    lines += _table(
        ["target", "asks", "measured", "verdict"],
        [
            [t.name, t.target, t.measured + (f" ({t.note})" if t.note else ""), t.verdict]
            for t in targets
        ],
    )
    lines.append("")
    if runs:
        lines += [
            f"## Workload runs ({SIM_LABEL}; time scale {time_scale:g})",
            "",
            "duty: fraction of the steady-state window some job is inside an accelerator "
            "phase of the shared group; bound: analytic bound with the configured switch cost "
            "(and with the measured mean switch wall time); slowdown: mean step time shared vs "
            "the same job alone on dedicated accelerators, same random draws.",
            "",
        ]
        lines += workload_table(list(runs.values()))
        lines += [
            "",
            "ideal: the same jobs simulated on a platform with no control-plane cost and the "
            "configured switch cost (bench/model.py), on this run's random draws and over "
            "400 steps; bound - ideal is what the jobs' variability costs (collisions), "
            "ideal - measured what the real platform adds.",
            "",
            f"Switches and waits (bench milliseconds; {SIM_LABEL}): data = slowest node's "
            "checkpoint + slowest node's restore from the agents' journals; control = switch "
            "wall - data.",
            "",
        ]
        lines += switch_table(list(runs.values()))
        lines.append("")
    if baseline_duty:
        lines += ["Dedicated baselines (each job alone on its own group), mean duty:", ""]
        lines += [f"- {name}: {_pct(d)}" for name, d in baseline_duty.items()]
        lines.append("")
    if handoff:
        lines += ["## Handoff latency (yield -> next waiter granted, no data movement)", ""]
        lines += _table(
            [
                "replicas",
                "samples",
                "handoff p50 / p99 / max ms",
                "yield call p50 / p99 ms",
                "status call p50 / p99 ms",
                "CPU s (orchestrator / etcd / bench)",
                _HOLDS_ONLY,
            ],
            [
                [
                    h.replicas,
                    h.samples,
                    f"{h.handoff_ms.p50:.2f} / {h.handoff_ms.p99:.2f} / {h.handoff_ms.max:.2f}",
                    f"{h.yield_call_ms.p50:.2f} / {h.yield_call_ms.p99:.2f}",
                    f"{h.status_call_ms.p50:.2f} / {h.status_call_ms.p99:.2f}",
                    " / ".join(
                        f"{h.cpu_seconds.get(k, 0):.2f}" for k in ("orchestrator", "etcd", "bench")
                    ),
                    "ok" if not h.violations else "VIOLATION",
                ]
                for h in handoff
            ],
        )
        lines.append("")
    if cycles:
        lines += ["## Acquire/yield throughput (one job per group, no data movement)", ""]
        lines += _table(
            [
                "groups",
                "replicas",
                "clients",
                "in flight",
                "cycles/s",
                "cycle p50 / p99 ms",
                "CPU ms per cycle (orchestrator / etcd / bench)",
                _HOLDS_ONLY,
            ],
            [
                [
                    c.groups,
                    c.replicas,
                    c.clients,
                    c.in_flight,
                    f"{c.cycles_per_second:.0f}",
                    f"{c.cycle_ms.p50:.1f} / {c.cycle_ms.p99:.1f}",
                    " / ".join(
                        f"{c.cpu_ms_per_cycle.get(k, 0):.2f}"
                        for k in ("orchestrator", "etcd", "bench")
                    ),
                    "ok" if not c.violations else "VIOLATION",
                ]
                for c in cycles
            ],
        )
        lines.append("")
    if memory is not None:
        lines += ["## Orchestrator memory per group (VmRSS of the replica)", ""]
        rows = [[0, f"{memory.points[0][1] / 2**20:.1f} MiB", "-"]]
        rows += [
            [n, f"{rss / 2**20:.1f} MiB", f"{per / 1024:.1f} KiB"]
            for (n, rss), per in zip(memory.points[1:], memory.bytes_per_group, strict=True)
        ]
        lines += _table(["groups", "RSS", "per group (vs 0 groups)"], rows)
        lines.append("")
    if fanout:
        lines += [
            "## Switch fan-out vs nodes (free transfers: --sim-time-scale 0)",
            "",
            "control = switch wall time (Grant.switch_seconds) - (slowest node's checkpoint "
            "+ slowest node's restore), both phases as the agents' journals recorded them.",
            "",
        ]
        lines += _table(
            [
                "nodes",
                "switches",
                "wall p50 / p99 ms",
                "agents p50 / p99 ms",
                "control p50 / p99 ms",
                "acquire p50 / p99 ms",
                "invariants (holds and journals)",
            ],
            [
                [
                    f.nodes,
                    f.switches,
                    _stats_cells(f.wall_ms),
                    _stats_cells(f.backend_ms),
                    _stats_cells(f.control_ms),
                    _stats_cells(f.acquire_ms),
                    "ok" if not f.violations else "VIOLATION",
                ]
                for f in fanout
            ],
        )
        lines.append("")
    if profile is not None:
        lines += [
            f"## Where the replica's CPU goes ({profile.groups} groups, cycle benchmark "
            f"under cProfile: {profile.cycles_per_second:.0f} cycles/s profiled)",
            "",
        ]
        lines += _table(
            ["code area", "share of the replica's own CPU time"],
            [[area, f"{share:.1%}"] for area, share in profile.by_area.items()],
        )
        lines.append("")
        lines += _table(
            ["function", "own time share", "own s", "cumulative s", "calls"],
            [
                [
                    f"`{r.function}`",
                    f"{r.own_share:.1%}",
                    f"{r.own_seconds:.2f}",
                    f"{r.cumulative_seconds:.2f}",
                    r.calls,
                ]
                for r in profile.top
            ],
        )
        lines.append("")
    if figures:
        lines += ["## Figures", ""]
        lines += [f"![{name}]({name})" for name in figures]
        lines.append("")
    return "\n".join(lines)
