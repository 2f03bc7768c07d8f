"""The demo behind ``make demo``: two synthetic synchronous-RL jobs, dedicated vs shared.

``python -m timeslice_tools.dev.demo`` starts a local cluster (1 orchestrator, 1 agent, sim backend
with a small modelled device state, so a context switch costs tens of milliseconds), then runs
two jobs as separate processes, twice:

1. dedicated: each job on a group of its own, concurrently;
2. shared: both jobs on one group, time-sliced by the orchestrator.

Each job loops over steps: an off-accelerator reward/environment phase (a sleep), then the
accelerator phases (rollout, train, weight sync) inside ``client.on_accelerators(...)``. Alone,
the accelerator is busy 40% of a step. Each job registers a worker with the node agent
(``timeslice.register`` with its state bytes), so every switch moves (emulated) state, and
records every phase to a JSONL file. The demo then prints per-group timelines, the switches,
the accelerator duty cycle of each setup and the per-job slowdown.

``python -m timeslice_tools.dev.demo job ...`` is the child mode that runs one job.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from timeslice.errors import TimeSliceError
from timeslice_tools.dev import _procs
from timeslice_tools.dev.cluster import ClusterError, LocalCluster
from timeslice_tools.dev.etcd import EtcdError
from timeslice_tools.dev.timeline import (
    DemoPhase,
    Interval,
    PhaseRecord,
    accelerator_intervals,
    duty_cycle,
    hold_spans,
    mean_or_zero,
    read_records,
    render_timeline,
    span_of,
    step_durations,
    switch_events,
)

if TYPE_CHECKING:
    from timeslice import Grant, TimeSliceOrchestratorClient

__all__ = ["DemoError", "DemoResult", "JobProfile", "main", "report", "run_demo"]

SIM_LABEL = "(sim backend: emulated data movement)"
GB = 1_000_000_000
# 1.5 GB of device state per job at 50 GB/s: 30 ms out and 30 ms in per switch.
STATE_BYTES = 3 * GB // 2
SIM_AGENT_ARGS = (
    "--sim-capacity-gb", "80",
    "--sim-bandwidth-gbps", "50",
    "--sim-state-gb", "1.5",
    "--sim-time-scale", "1.0",
)  # fmt: skip
DEFAULT_STEPS = 16
DEFAULT_DEADLINE = 110.0
TIMELINE_WIDTH = 100
TIMELINE_SECONDS = 8.0
_START_DELAY = 0.2
_READY_TIMEOUT = 30.0
_POLL_SECONDS = 0.01


class DemoError(RuntimeError):
    """A demo job or the cluster failed; the message carries the relevant log tail."""


@dataclass(frozen=True)
class JobProfile:
    """Seconds per phase of one synthetic synchronous-RL step."""

    reward_seconds: float = 0.6
    rollout_seconds: float = 0.2
    train_seconds: float = 0.15
    sync_seconds: float = 0.05

    @property
    def accelerator_seconds(self) -> float:
        return self.rollout_seconds + self.train_seconds + self.sync_seconds

    @property
    def step_seconds(self) -> float:
        return self.reward_seconds + self.accelerator_seconds

    @property
    def accelerator_fraction(self) -> float:
        return self.accelerator_seconds / self.step_seconds


@dataclass(frozen=True)
class DemoJob:
    label: str  # one character, used in timelines
    job_id: str


JOBS = (DemoJob("A", "demo-job-a"), DemoJob("B", "demo-job-b"))


@dataclass(frozen=True)
class Setup:
    """How the jobs map to groups in one run."""

    name: str
    groups: dict[str, str]  # job label -> group


DEDICATED = Setup("dedicated", {"A": "demo-dedicated-a", "B": "demo-dedicated-b"})
SHARED = Setup("shared", {"A": "demo-shared", "B": "demo-shared"})


@dataclass(frozen=True)
class DemoResult:
    """The records of both runs, for the report (and for tests)."""

    dedicated: list[PhaseRecord]
    shared: list[PhaseRecord]
    profile: JobProfile


# -- the parent: cluster, runs, report --------------------------------------------------------


def run_demo(
    *,
    steps: int = DEFAULT_STEPS,
    profile: JobProfile | None = None,
    base_dir: Path | None = None,
    deadline_seconds: float = DEFAULT_DEADLINE,
    out: TextIO = sys.stdout,
) -> DemoResult:
    """Start a cluster, run the dedicated then the shared setup, print the report."""
    profile = profile or JobProfile()
    deadline = time.monotonic() + deadline_seconds
    owns_work = base_dir is None
    work = Path(tempfile.mkdtemp(prefix="timeslice-demo-")) if base_dir is None else base_dir
    work.mkdir(parents=True, exist_ok=True)
    result = _run_in(work, steps, profile, deadline, out)
    # Kept on failure (the error names it) so the logs can be read; removed after a success.
    if owns_work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def _run_in(
    work: Path, steps: int, profile: JobProfile, deadline: float, out: TextIO
) -> DemoResult:
    _say(out, f"timeslice demo {SIM_LABEL}")
    _say(out, f"  work dir {work}")
    cluster = LocalCluster(
        replicas=1,
        agents=1,
        backend="sim",
        agent_args=SIM_AGENT_ARGS,
        base_dir=work / "cluster",
        ready_timeout=min(30.0, max(1.0, deadline - time.monotonic())),
        tls=True,
    )
    try:
        cluster.start()
        _say(out, f"  cluster ready: orchestrator {cluster.target}, agent node-0 (sim)")
        _say(
            out,
            f"  each job: {steps} steps of {profile.step_seconds:.2f} s alone, accelerator "
            f"{profile.accelerator_fraction:.0%} of a step, {STATE_BYTES / GB:.1f} GB device state",
        )
        runs: dict[str, list[PhaseRecord]] = {}
        for setup in (DEDICATED, SHARED):
            mapping = ", ".join(f"{job.label}={setup.groups[job.label]}" for job in JOBS)
            _say(out, f"  running {setup.name}: {mapping}")
            runs[setup.name] = _run_setup(
                cluster, setup, steps, profile, work / setup.name, deadline
            )
    finally:
        cluster.stop()
    result = DemoResult(dedicated=runs["dedicated"], shared=runs["shared"], profile=profile)
    out.write(report(result))
    out.flush()
    return result


def _say(out: TextIO, line: str) -> None:
    out.write(line + "\n")
    out.flush()


def _job_argv(
    job: DemoJob,
    group: str,
    cluster: LocalCluster,
    steps: int,
    profile: JobProfile,
    run_dir: Path,
) -> list[str]:
    return [
        sys.executable, "-m", "timeslice_tools.dev.demo", "job",
        "--job-id", job.job_id,
        "--group", group,
        "--target", cluster.target,
        "--agent-socket", str(cluster.agent_sockets["node-0"]),
        "--state-bytes", str(STATE_BYTES),
        "--steps", str(steps),
        "--reward-seconds", repr(profile.reward_seconds),
        "--rollout-seconds", repr(profile.rollout_seconds),
        "--train-seconds", repr(profile.train_seconds),
        "--sync-seconds", repr(profile.sync_seconds),
        "--ready-file", str(run_dir / f"{job.label}.ready"),
        "--go-file", str(run_dir / "go"),
        "--out", str(run_dir / f"{job.label}.jsonl"),
    ]  # fmt: skip


def _run_setup(
    cluster: LocalCluster,
    setup: Setup,
    steps: int,
    profile: JobProfile,
    run_dir: Path,
    deadline: float,
) -> list[PhaseRecord]:
    """Run both jobs to completion on ``setup``'s groups and return their records."""
    run_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {job.label: run_dir / f"{job.label}.log" for job in JOBS}
    try:
        for job in JOBS:
            argv = _job_argv(job, setup.groups[job.label], cluster, steps, profile, run_dir)
            # Each job with its own certificate: it may act as itself only (the operator's
            # is for operators), and has a bucket and a quota of groups of its own.
            env = dict(os.environ, PYTHONUNBUFFERED="1", **cluster.job_env(job.job_id))
            procs[job.label] = _procs.spawn(argv, logs[job.label], env=env)
        # Both jobs import the SDK, connect and register first; then they start together.
        ready = [run_dir / f"{job.label}.ready" for job in JOBS]
        _wait_until(
            lambda: all(p.exists() for p in ready),
            min(deadline, time.monotonic() + _READY_TIMEOUT),
            f"{setup.name} jobs to get ready",
            procs,
            logs,
        )
        go_tmp = run_dir / "go.tmp"
        go_tmp.write_text(repr(time.time() + _START_DELAY))
        go_tmp.rename(run_dir / "go")  # atomic: a job never reads a half-written file
        _wait_until(
            lambda: all(p.poll() is not None for p in procs.values()),
            deadline,
            f"{setup.name} jobs to finish",
            procs,
            logs,
        )
    finally:
        _procs.terminate_all(procs.values(), grace=2.0)
    records: list[PhaseRecord] = []
    for job in JOBS:
        records.extend(read_records(run_dir / f"{job.label}.jsonl"))
    return records


def _wait_until(
    done: Callable[[], bool],
    deadline: float,
    what: str,
    procs: dict[str, subprocess.Popen[bytes]],
    logs: dict[str, Path],
) -> None:
    while not done():
        for label, proc in procs.items():
            code = proc.poll()
            if code is not None and code != 0:
                raise DemoError(
                    f"job {label} exited with status {code} while waiting for {what}; "
                    f"log {logs[label]}:\n{_procs.log_tail(logs[label])}"
                )
        if time.monotonic() >= deadline:
            tails = "\n".join(f"--- job {k}:\n{_procs.log_tail(v, 15)}" for k, v in logs.items())
            raise DemoError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.05)
    for label, proc in procs.items():
        code = proc.poll()
        if code is not None and code != 0:
            raise DemoError(
                f"job {label} exited with status {code}; log {logs[label]}:\n"
                f"{_procs.log_tail(logs[label])}"
            )


# -- the report (pure: records in, text out) --------------------------------------------------


def _labels(records: Sequence[PhaseRecord]) -> dict[str, str]:
    by_id = {job.job_id: job.label for job in JOBS}
    return {r.job: by_id.get(r.job, r.job[:1].upper() or "?") for r in records}


def _timeline_rows(records: Sequence[PhaseRecord], groups: Sequence[str]) -> list[str]:
    run = span_of(records)
    # The same time scale for every run, so dedicated and shared rows compare column by column.
    window = Interval(run.start, min(run.end, run.start + TIMELINE_SECONDS))
    labels = _labels(records)
    name_width = max(len(g) for g in groups)
    end_label = f"{window.duration:.1f} s"
    rows = [f"    {'':{name_width}}  0 s{end_label:>{TIMELINE_WIDTH - 3}}"]
    for group in groups:
        spans = [(labels[job], span) for job, span in hold_spans(records, group)]
        # One column per switch (at its midpoint): a switch shorter than a column must not
        # hide the holds on both sides of it.
        marks = [
            Interval(mid, mid)
            for e in switch_events(records)
            if e.group == group and e.from_job
            for mid in [e.at - e.seconds / 2]
        ]
        line = render_timeline(spans, window, marks=marks, width=TIMELINE_WIDTH)
        rows.append(f"    {group:{name_width}} |{line}|")
    return rows


def report(result: DemoResult) -> str:
    """The demo's text report: timelines, switches, duty cycles and step times."""
    lines: list[str] = []
    legend = ", ".join(f"{job.label} = {job.job_id}" for job in JOBS)
    lines.append("")
    lines.append(f"Timelines {SIM_LABEL}")
    column_ms = TIMELINE_SECONDS / TIMELINE_WIDTH * 1000
    lines.append(
        f"  first {TIMELINE_SECONDS:g} s of each run, one column = {column_ms:g} ms; "
        f"{legend}; . idle; S switch"
    )
    groups_ded = sorted(set(DEDICATED.groups.values()))
    groups_sh = sorted(set(SHARED.groups.values()))
    lines.append("  dedicated groups (one per job, run concurrently):")
    lines.extend(_timeline_rows(result.dedicated, groups_ded))
    lines.append("  shared group (both jobs time-sliced):")
    lines.extend(_timeline_rows(result.shared, groups_sh))

    lines.append("")
    lines.append(f"Switches on the shared group {SIM_LABEL}")
    t0 = span_of(result.shared).start
    events = [e for e in switch_events(result.shared) if e.from_job]
    labels = _labels(result.shared)
    for event in events:
        lines.append(
            f"  t={event.at - t0:6.2f} s  {labels.get(event.from_job, event.from_job)} -> "
            f"{labels.get(event.to_job, event.to_job)}  switch {event.seconds * 1000:6.1f} ms"
        )
    if events:
        mean_ms = mean_or_zero([e.seconds for e in events]) * 1000
        lines.append(f"  {len(events)} switches, mean {mean_ms:.1f} ms")
    else:
        lines.append("  none")

    lines.append("")
    lines.append(f"Accelerator duty cycle {SIM_LABEL}")
    lines.append("  (fraction of the run's wall time some job is inside an accelerator phase)")
    ded_window = span_of(result.dedicated)
    for group in groups_ded:
        value = duty_cycle(accelerator_intervals(result.dedicated, group), ded_window)
        lines.append(f"  dedicated  {group:20} {value:6.1%}")
    sh_window = span_of(result.shared)
    for group in groups_sh:
        value = duty_cycle(accelerator_intervals(result.shared, group), sh_window)
        lines.append(f"  shared     {group:20} {value:6.1%}")
    lines.append(
        f"  accelerators used: 2 groups for {ded_window.duration:.1f} s dedicated vs 1 group "
        f"for {sh_window.duration:.1f} s shared"
    )

    lines.append("")
    lines.append(f"Mean step time per job {SIM_LABEL}")
    lines.append(f"  {'job':12} {'dedicated':>10} {'shared':>10} {'slowdown':>9}")
    for job in JOBS:
        ded = mean_or_zero(step_durations(result.dedicated, job.job_id))
        sh = mean_or_zero(step_durations(result.shared, job.job_id))
        slowdown = f"{sh / ded:8.2f}x" if ded > 0 else "       ?"
        lines.append(f"  {job.job_id:12} {ded:9.3f}s {sh:9.3f}s {slowdown}")
    lines.append("")
    return "\n".join(lines)


# -- the child: one synthetic RL job ----------------------------------------------------------


def run_job(args: argparse.Namespace) -> int:
    """One job: register a worker, wait for the go signal, run the steps, record phases."""
    # Imported here so the parent (and the report) never needs the SDK's gRPC stack.
    from timeslice import TimeSliceOrchestratorClient, register

    profile = JobProfile(
        reward_seconds=args.reward_seconds,
        rollout_seconds=args.rollout_seconds,
        train_seconds=args.train_seconds,
        sync_seconds=args.sync_seconds,
    )
    client = TimeSliceOrchestratorClient(args.target, job_id=args.job_id)
    try:
        registration = register(
            args.group,
            job_id=args.job_id,
            pid=os.getpid(),
            state_bytes=args.state_bytes,
            socket=args.agent_socket,
            # This process calls acquire itself; a freeze backend must never stop it.
            acquirer=True,
        )
        try:
            args.ready_file.write_text("ready\n")
            start_at = _wait_for_go(args.go_file, _READY_TIMEOUT)
            time.sleep(max(0.0, start_at - time.time()))
            with args.out.open("w", encoding="utf-8") as out:
                _run_steps(client, args.job_id, args.group, args.steps, profile, out)
        finally:
            registration.close()
    finally:
        client.close()
    return 0


def _run_steps(
    client: TimeSliceOrchestratorClient,
    job_id: str,
    group: str,
    steps: int,
    profile: JobProfile,
    out: TextIO,
) -> None:
    def record(phase: DemoPhase, step: int, start: float, end: float, grant: Grant | None) -> None:
        rec = PhaseRecord(
            job=job_id,
            phase=phase,
            group=group,
            step=step,
            start=start,
            end=end,
            epoch=grant.epoch if grant else 0,
            restored=grant.restored if grant else False,
            switch_seconds=grant.switch_seconds if grant else 0.0,
            previous_job=_previous_job(grant, job_id) if grant else "",
        )
        out.write(rec.to_json() + "\n")

    accelerator_phases = (
        (DemoPhase.ROLLOUT, profile.rollout_seconds),
        (DemoPhase.TRAIN, profile.train_seconds),
        (DemoPhase.SYNC, profile.sync_seconds),
    )
    for step in range(steps):
        start = time.time()
        time.sleep(profile.reward_seconds)
        record(DemoPhase.REWARD, step, start, time.time(), None)
        asked = time.time()
        with client.on_accelerators(group, timeout=_READY_TIMEOUT) as grant:
            record(DemoPhase.WAIT, step, asked, time.time(), grant)
            for phase, seconds in accelerator_phases:
                begin = time.time()
                time.sleep(seconds)
                record(phase, step, begin, time.time(), grant)
    out.flush()


def _previous_job(grant: Grant, job_id: str) -> str:
    """The job whose state a grant moved out. A job's certificate does not show other jobs'
    ids (docs/security.md, "Reads"): of the demo's two jobs, the one hidden is the other."""
    seen = grant.previous_job_id or ""
    others = {job.job_id for job in JOBS} - {job_id}
    if seen and seen != job_id and seen not in others and len(others) == 1:
        return others.pop()
    return seen


def _wait_for_go(path: Path, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() >= deadline:
            raise DemoError(f"no go signal ({path}) within {timeout:g} s")
        time.sleep(_POLL_SECONDS)
    return float(path.read_text())


# -- command line -----------------------------------------------------------------------------


def _job_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m timeslice_tools.dev.demo job")
    p.add_argument("--job-id", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--agent-socket", required=True)
    p.add_argument("--state-bytes", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--reward-seconds", type=float, required=True)
    p.add_argument("--rollout-seconds", type=float, required=True)
    p.add_argument("--train-seconds", type=float, required=True)
    p.add_argument("--sync-seconds", type=float, required=True)
    p.add_argument("--ready-file", type=Path, required=True)
    p.add_argument("--go-file", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    return p


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m timeslice_tools.dev.demo",
        description="Two synthetic RL jobs on dedicated groups, then on one shared group "
        f"{SIM_LABEL}.",
    )
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per job and setup")
    p.add_argument("--base-dir", type=Path, help="keep logs and records here (default: temp)")
    p.add_argument(
        "--deadline", type=float, default=DEFAULT_DEADLINE, help="give up after this many s"
    )
    return p


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo (or, with ``job`` first, one demo job). Returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["job"]:
        return run_job(_job_parser().parse_args(args_list[1:]))
    args = _run_parser().parse_args(args_list)
    if args.steps < 2:
        print("error: invalid_argument: --steps must be at least 2", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the `finally` blocks stop the jobs and the cluster.
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    try:
        run_demo(steps=args.steps, base_dir=args.base_dir, deadline_seconds=args.deadline)
    except (DemoError, ClusterError, EtcdError, TimeSliceError, OSError) as exc:
        print(f"error: demo failed: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("error: demo interrupted", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
