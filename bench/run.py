"""Run a benchmark suite and write its results: JSON, a Markdown summary and PNG figures.

    python -m bench.run --suite full            # about 17 minutes on 2 cores
    python -m bench.run --suite quick           # about 70 seconds
    python -m bench.run --suite quick --out /tmp/bench

Both write to ``bench/results`` unless ``--out`` says otherwise, without overwriting each
other: ``full`` writes ``full.json``, ``summary.md`` and ``<figure>.png``; ``quick`` writes
``quick.json``, ``summary-quick.md`` and ``quick-<figure>.png``.

``full`` runs every workload profile (dedicated baseline and shared, with the duty cycle
against the number of jobs and against the switch cost, and the reference's switch costs) and
every control-plane benchmark (handoff latency, acquire/yield throughput against groups and
replicas, memory per group, switch fan-out against nodes, a cProfile of the replica).
``quick`` is a subset: 2 balanced jobs and one point of each control-plane benchmark.

Everything runs against real processes on this machine with the sim backend: **data movement
is emulated**, and every table and figure says so. The exit status is 1 when a run failed or
an invariant check (mutual exclusion, FIFO, fencing, two-phase order) found a violation;
missed performance targets are reported, not failed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from bench import controlplane, figures
from bench._common import code_version, machine_info
from bench.controlplane import CyclesResult, FanoutResult, HandoffResult, MemoryResult
from bench.controlplane import ProfileResult as OrchestratorProfile
from bench.figures import DutyPoint
from bench.profiles import PROFILES, get_profile
from bench.report import check_targets, render_summary
from bench.workload import (
    DEFAULT_COSTS,
    REFERENCE_COSTS,
    Baseline,
    RunResult,
    SimCosts,
    WorkloadError,
    arun_profile,
    measure_baseline,
)
from timeslice.errors import TimeSliceError
from timeslice_tools.dev.cluster import ClusterError

__all__ = ["FULL", "QUICK", "SUITES", "SuiteConfig", "main", "run_suite"]

T = TypeVar("T")
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class SuiteConfig:
    """What a suite runs. Workload runs share ``time_scale``, ``steps``, ``nodes``, ``seed``."""

    name: str
    time_scale: float
    steps: int
    nodes: int = 2
    seed: int = 1
    jobs_sweep: tuple[int, ...] = (2,)  # balanced, default costs (1 = dedicated baseline)
    reference_jobs: tuple[int, ...] = ()  # balanced with the reference's switch costs
    switch_sweep: tuple[float, ...] = ()  # extra real switch seconds for 2 balanced jobs
    other_profiles: tuple[str, ...] = ()  # 2 jobs each, default costs
    handoff_replicas: tuple[int, ...] = (1,)
    handoff_samples: int = 100
    cycle_groups: tuple[int, ...] = (100,)
    cycle_replicas: tuple[int, ...] = (1,)
    cycle_seconds: float = 4.0
    memory_counts: tuple[int, ...] = (500,)
    fanout_nodes: tuple[int, ...] = (4,)
    fanout_switches: int = 30
    profile_orchestrator: bool = False


FULL = SuiteConfig(
    name="full",
    time_scale=0.03,
    steps=12,
    jobs_sweep=(1, 2, 3, 4),
    reference_jobs=(2, 3),
    switch_sweep=(0.0, 5.0, 10.0),
    other_profiles=("balanced-fixed", "rollout-heavy", "train-heavy", "async", "long-tail"),
    handoff_replicas=(1, 3),
    handoff_samples=300,
    cycle_groups=(1, 10, 100, 1000),
    cycle_replicas=(1, 3),
    cycle_seconds=6.0,
    memory_counts=(1000, 2000),
    fanout_nodes=(1, 4, 8, 16),
    fanout_switches=60,
    profile_orchestrator=True,
)
QUICK = SuiteConfig(name="quick", time_scale=0.02, steps=8)
SUITES = {"full": FULL, "quick": QUICK}


@dataclass
class SuiteResults:
    """Everything a suite measured, as written to ``<suite>.json``."""

    config: SuiteConfig
    machine: dict[str, Any]
    baselines: dict[str, Baseline] = field(default_factory=dict)
    runs: dict[str, RunResult] = field(default_factory=dict)
    jobs_sweep: list[DutyPoint] = field(default_factory=list)
    switch_sweep: list[DutyPoint] = field(default_factory=list)
    handoff: list[HandoffResult] = field(default_factory=list)
    cycles: list[CyclesResult] = field(default_factory=list)
    memory: MemoryResult | None = None
    fanout: list[FanoutResult] = field(default_factory=list)
    profile: OrchestratorProfile | None = None
    errors: dict[str, str] = field(default_factory=dict)
    figures: list[str] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def violations(self) -> list[str]:
        found = [f"{k}: {v}" for k, r in self.runs.items() for v in r.violations]
        found += [f"handoff r{h.replicas}: {v}" for h in self.handoff for v in h.violations]
        found += [
            f"cycles g{c.groups} r{c.replicas}: {v}" for c in self.cycles for v in c.violations
        ]
        found += [f"fanout n{f.nodes}: {v}" for f in self.fanout for v in f.violations]
        if self.memory is not None:
            found += [f"memory: {v}" for v in self.memory.violations]
        return found

    def to_json(self) -> dict[str, Any]:
        return {
            "suite": self.config.name,
            "config": asdict(self.config),
            "machine": self.machine,
            "note": "sim backend: emulated data movement; bench seconds unless named real",
            "wall_seconds": self.wall_seconds,
            "targets": [
                {**asdict(t), "verdict": t.verdict}
                for t in check_targets(self.runs, self.handoff, self.cycles, self.fanout)
            ],
            "baselines": {k: asdict(v) for k, v in self.baselines.items()},
            "runs": {k: v.to_json() for k, v in self.runs.items()},
            "duty_vs_jobs": [asdict(p) for p in self.jobs_sweep],
            "duty_vs_switch": [asdict(p) for p in self.switch_sweep],
            "handoff": [h.to_json() for h in self.handoff],
            "cycles": [c.to_json() for c in self.cycles],
            "memory": self.memory.to_json() if self.memory is not None else None,
            "fanout": [f.to_json() for f in self.fanout],
            "orchestrator_profile": self.profile.to_json() if self.profile else None,
            "errors": self.errors,
            "violations": self.violations,
            "figures": self.figures,
        }


def same_code(start: str, end: str) -> bool:
    """Whether two :func:`code_version` readings name the same service code."""
    if "dirty" in start.split() or "dirty" in end.split():
        return start == end
    return start.split()[1:] == end.split()[1:]


def _say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


async def _step(results: SuiteResults, name: str, action: Callable[[], Awaitable[T]]) -> T | None:
    """Run one benchmark; a failure is recorded under ``name`` and the suite goes on."""
    _say(f"{name} ...")
    started = time.monotonic()
    try:
        value = await action()
    except (WorkloadError, ClusterError, TimeSliceError, OSError, RuntimeError, ValueError) as exc:
        results.errors[name] = f"{type(exc).__name__}: {exc}"
        _say(f"{name} FAILED after {time.monotonic() - started:.0f} s: {exc}")
        return None
    _say(f"{name} done in {time.monotonic() - started:.0f} s")
    return value


async def _workloads(cfg: SuiteConfig, results: SuiteResults) -> None:
    balanced = get_profile("balanced")
    common: dict[str, Any] = {
        "time_scale": cfg.time_scale,
        "steps": cfg.steps,
        "nodes": cfg.nodes,
        "seed": cfg.seed,
    }
    most = max((*cfg.jobs_sweep, *cfg.reference_jobs, 2 if cfg.switch_sweep else 1))
    base = await _step(
        results,
        f"baseline balanced x{most}",
        lambda: measure_baseline(balanced, most, **common),
    )
    if base is None:
        return
    results.baselines["balanced"] = base

    async def shared(label: str, jobs: int, sim: SimCosts) -> RunResult | None:
        run = await _step(
            results,
            label,
            lambda: arun_profile(balanced, jobs, sim=sim, baseline=base, label=label, **common),
        )
        if run is not None:
            results.runs[label] = run
        return run

    for n in cfg.jobs_sweep:
        if n == 1:
            # One job alone on a group is exactly the dedicated baseline's setup.
            duty = math.fsum(base.duty) / len(base.duty)
            results.jobs_sweep.append(DutyPoint(1, duty, balanced.busy_fraction, "dedicated"))
            continue
        run = await shared(f"balanced-n{n}", n, DEFAULT_COSTS)
        if run is not None:
            results.jobs_sweep.append(DutyPoint(n, run.main_duty, run.analytic_bound))
    for n in cfg.reference_jobs:
        await shared(f"balanced-n{n}-reference", n, REFERENCE_COSTS)
    if cfg.switch_sweep:
        for seconds in cfg.switch_sweep:
            sim = SimCosts.for_switch(seconds, f"{seconds:g} s per switch")
            await shared(f"balanced-n2-switch{seconds:g}s", 2, sim)
        points = [r for r in results.runs.values() if r.profile == "balanced" and r.jobs == 2]
        results.switch_sweep = sorted(
            (
                DutyPoint(r.switch_seconds_real, r.main_duty, r.analytic_bound, r.label)
                for r in points
            ),
            key=lambda p: p.x,
        )
    for name in cfg.other_profiles:
        label = f"{name}-n2"
        run = await _step(
            results,
            label,
            functools.partial(arun_profile, get_profile(name), 2, label=label, **common),
        )
        if run is not None:
            results.runs[label] = run


async def _controlplane(cfg: SuiteConfig, results: SuiteResults) -> None:
    for r in cfg.handoff_replicas:
        h = await _step(
            results,
            f"handoff r{r}",
            functools.partial(controlplane.handoff_latency, r, cfg.handoff_samples),
        )
        if h is not None:
            results.handoff.append(h)
    for r in cfg.cycle_replicas:
        for g in cfg.cycle_groups:
            c = await _step(
                results,
                f"cycles g{g} r{r}",
                functools.partial(controlplane.cycle_throughput, g, r, seconds=cfg.cycle_seconds),
            )
            if c is not None:
                results.cycles.append(c)
    results.memory = await _step(
        results, "memory", lambda: controlplane.memory_per_group(cfg.memory_counts)
    )
    for n in cfg.fanout_nodes:
        f = await _step(
            results,
            f"fanout n{n}",
            functools.partial(controlplane.switch_fanout, n, cfg.fanout_switches),
        )
        if f is not None:
            results.fanout.append(f)
    if cfg.profile_orchestrator:
        results.profile = await _step(
            results,
            "profile",
            lambda: controlplane.profile_orchestrator(100, seconds=cfg.cycle_seconds),
        )


def output_name(suite: str, name: str) -> str:
    """A result file's name: the full suite's as is, other suites' marked with their name.

    ``summary.md`` -> ``summary-quick.md``, ``duty.png`` -> ``quick-duty.png``, so suites
    can share one results directory.
    """
    if suite == "full":
        return name
    if name == "summary.md":
        return f"summary-{suite}.md"
    return f"{suite}-{name}"


def _figures(results: SuiteResults, out: Path) -> list[str]:
    scale = results.config.time_scale

    def at(name: str) -> Path:
        return out / output_name(results.config.name, name)

    made: list[Path] = []
    for label in ("balanced-n2", "balanced-n3", "balanced-n2-reference", "long-tail-n2"):
        run = results.runs.get(label)
        if run is not None:
            made.append(figures.timeline_figure(run, at(f"timeline-{label}.png")))
    if len(results.jobs_sweep) > 1:
        made.append(
            figures.duty_vs_jobs_figure(
                results.jobs_sweep, at("duty-vs-jobs.png"), time_scale=scale
            )
        )
    if len(results.switch_sweep) > 1:
        made.append(
            figures.duty_vs_switch_figure(
                results.switch_sweep, at("duty-vs-switch-cost.png"), time_scale=scale
            )
        )
    if results.cycles:
        made.append(figures.cycles_figure(results.cycles, at("cycles-vs-groups.png")))
    if results.fanout:
        made.append(figures.fanout_figure(results.fanout, at("fanout-vs-nodes.png")))
    return [p.name for p in made]


async def run_suite(cfg: SuiteConfig, out: Path) -> SuiteResults:
    """Run ``cfg`` and write its JSON, summary and figures to ``out`` (see :func:`output_name`)."""
    started = time.monotonic()
    results = SuiteResults(cfg, await asyncio.to_thread(machine_info))
    await _workloads(cfg, results)
    await _controlplane(cfg, results)
    results.wall_seconds = time.monotonic() - started
    end = await asyncio.to_thread(code_version)
    results.machine["commit_at_end"] = end
    results.machine["same_code"] = same_code(str(results.machine["commit"]), end)
    await asyncio.to_thread(_write, results, out)
    return results


def _write(results: SuiteResults, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results.figures = _figures(results, out)
    cfg = results.config
    (out / f"{cfg.name}.json").write_text(
        json.dumps(_finite(results.to_json()), indent=1, allow_nan=False) + "\n"
    )
    summary = render_summary(
        suite=cfg.name,
        machine=results.machine,
        time_scale=cfg.time_scale,
        steps=cfg.steps,
        runs=results.runs,
        baseline_duty={k: math.fsum(b.duty) / len(b.duty) for k, b in results.baselines.items()},
        handoff=results.handoff,
        cycles=results.cycles,
        memory=results.memory,
        fanout=results.fanout,
        profile=results.profile,
        targets=check_targets(results.runs, results.handoff, results.cycles, results.fanout),
        figures=results.figures,
        errors=results.errors,
        wall_seconds=results.wall_seconds,
    )
    (out / output_name(cfg.name, "summary.md")).write_text(summary)


def _finite(value: Any) -> Any:
    """The same structure with NaN/inf (empty samples) as null: strict JSON has no NaN."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--suite", choices=sorted(SUITES), default="quick")
    parser.add_argument(
        "--out", type=Path, default=RESULTS_DIR, help="output directory (default: bench/results)"
    )
    args = parser.parse_args(argv)
    cfg = SUITES[args.suite]
    out: Path = args.out
    _say(f"suite {cfg.name}: profiles {', '.join(sorted(PROFILES))}; results to {out}")
    results = asyncio.run(run_suite(cfg, out))
    summary = out / output_name(cfg.name, "summary.md")
    print(summary.read_text())
    problems = [*results.errors.values(), *results.violations]
    if problems:
        _say(f"{len(problems)} problem(s): " + "; ".join(problems[:5]))
        return 1
    _say(f"done in {results.wall_seconds / 60:.1f} min; see {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
