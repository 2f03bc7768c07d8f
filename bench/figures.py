"""PNG figures of a benchmark suite (matplotlib, headless).

Every figure says in its title that data movement is emulated by the sim backend and gives
the time scale of the run, so no figure is ever read as a measurement on accelerators.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# The object API (Figure, no pyplot) renders with Agg and needs no display or global state.
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from bench._common import SIM_LABEL
from bench.controlplane import CyclesResult, FanoutResult
from bench.workload import RunResult

__all__ = [
    "DutyPoint",
    "cycles_figure",
    "duty_vs_jobs_figure",
    "duty_vs_switch_figure",
    "fanout_figure",
    "timeline_figure",
]

_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2"]
_DPI = 110


@dataclass(frozen=True)
class DutyPoint:
    """One point of a duty-cycle sweep: x, the measured duty and the analytic bound."""

    x: float
    measured: float
    bound: float
    label: str = ""


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    return path


def timeline_figure(result: RunResult, path: Path, *, seconds: float | None = None) -> Path:
    """Who held the shared group when: one row per job, switches as a row of their own.

    ``seconds`` limits the plot to the start of the run (default: six steps of the jobs).
    """
    span = seconds if seconds is not None else 6 * result.step_seconds_real * result.time_scale
    jobs = sorted({h.job for h in result.holds})
    fig = Figure(figsize=(10, 1.2 + 0.45 * (len(jobs) + 1)))
    ax = fig.subplots()
    for row, job in enumerate(jobs):
        bars = [(h.start, h.end - h.start) for h in result.holds if h.job == job and h.start < span]
        ax.broken_barh(bars, (row + 0.1, 0.8), facecolors=_COLOURS[row % len(_COLOURS)])
    switch_row = len(jobs)
    switches = [(a, b - a) for a, b in result.switch_spans if a < span]
    ax.broken_barh(switches, (switch_row + 0.1, 0.8), facecolors="#d62728")
    ax.set_yticks([r + 0.5 for r in range(len(jobs) + 1)], [*jobs, "switch (agents)"])
    ax.set_xlim(0, span)
    ax.set_ylim(0, len(jobs) + 1)
    ax.invert_yaxis()
    ax.set_xlabel(
        f"bench seconds (time scale {result.time_scale:g}: 1 bench s = "
        f"{1 / result.time_scale:g} real s)"
    )
    ax.set_title(
        f"{result.label}: holds of the shared group, duty {result.main_duty:.1%}\n"
        f"({SIM_LABEL}; switch {result.switch_seconds_real:g} s real)",
        fontsize=10,
    )
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def _duty_axes(
    points: Sequence[DutyPoint], xlabel: str, title: str, path: Path, *, log_x: bool = False
) -> Path:
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    xs = [p.x for p in points]
    ax.plot(
        xs,
        [p.bound for p in points],
        "--",
        color="grey",
        marker="o",
        mfc="none",
        label="analytic bound",
    )
    ax.plot(xs, [p.measured for p in points], "-", color=_COLOURS[0], marker="o", label="measured")
    for p in points:
        ax.annotate(
            f"{p.measured:.1%}",
            (p.x, p.measured),
            textcoords="offset points",
            xytext=(0, -14),
            ha="center",
            fontsize=8,
        )
    if log_x:
        ax.set_xscale("symlog", linthresh=1.0)
    if not log_x:
        ax.set_xticks(xs)
    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("duty cycle of the shared group")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def duty_vs_jobs_figure(points: Sequence[DutyPoint], path: Path, *, time_scale: float) -> Path:
    """Duty cycle against the number of jobs sharing the group (balanced profile)."""
    return _duty_axes(
        points,
        "jobs sharing one group (1 = a job alone on dedicated accelerators)",
        f"Duty cycle vs number of jobs, balanced profile, switch 1.6 s per 100 s step\n"
        f"({SIM_LABEL}; time scale {time_scale:g})",
        path,
    )


def duty_vs_switch_figure(points: Sequence[DutyPoint], path: Path, *, time_scale: float) -> Path:
    """Duty cycle of 2 balanced jobs against the switch cost (real seconds per switch)."""
    return _duty_axes(
        points,
        "data movement per switch, real seconds (checkpoint + restore; step = 100 s)",
        f"Duty cycle vs switch cost, 2 balanced jobs\n({SIM_LABEL}; time scale {time_scale:g})",
        path,
        log_x=True,
    )


def cycles_figure(results: Sequence[CyclesResult], path: Path) -> Path:
    """Acquire/yield cycles per second against the number of groups, per replica count."""
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    for i, replicas in enumerate(sorted({r.replicas for r in results})):
        rows = sorted((r for r in results if r.replicas == replicas), key=lambda r: r.groups)
        ax.plot(
            [r.groups for r in rows],
            [r.cycles_per_second for r in rows],
            marker="o",
            color=_COLOURS[i],
            label=f"{replicas} replica{'s' if replicas > 1 else ''}",
        )
    ax.axhline(500, color="grey", ls="--", label="target (100 groups)")
    ax.set_xscale("log")
    ax.set_xlabel("groups (one job each; up to 100 acquires in flight)")
    ax.set_ylabel("acquire/yield cycles per second")
    ax.set_title(
        "Acquire/yield throughput, no data movement\n(one 2-core machine runs "
        "etcd, the replicas and the load generator)",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def fanout_figure(results: Sequence[FanoutResult], path: Path) -> Path:
    """Switch control-plane overhead (wall minus slowest node's backend time) against nodes."""
    fig = Figure(figsize=(7, 4.2))
    ax = fig.subplots()
    rows = sorted(results, key=lambda r: r.nodes)
    nodes = [r.nodes for r in rows]
    ax.plot(
        nodes,
        [r.control_ms.p50 for r in rows],
        marker="o",
        color=_COLOURS[0],
        label="control plane p50",
    )
    ax.plot(
        nodes,
        [r.control_ms.p99 for r in rows],
        marker="o",
        color=_COLOURS[1],
        label="control plane p99",
    )
    ax.plot(
        nodes,
        [r.backend_ms.p50 for r in rows],
        marker="s",
        color="grey",
        ls=":",
        label="slowest node's agent time p50",
    )
    ax.axhline(20, color="grey", ls="--", label="target p50 (4 nodes)")
    ax.set_xticks(nodes)
    ax.set_xlabel("nodes in the group (one agent each)")
    ax.set_ylabel("milliseconds per switch")
    ax.set_title(
        f"Switch fan-out with free transfers (--sim-time-scale 0)\n({SIM_LABEL})", fontsize=10
    )
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)
