"""``make demo-rl``: two real GRPO jobs time-sliced on one group, proven to train exactly as alone.

    python -m timeslice_tools.dev.rl [--steps 100] [--corrupt JOB:STEP] [--keep]

1. Each job (:mod:`timeslice_tools.dev.rl.job`: TRL's ``GRPOTrainer``, a tiny policy built in
   code) runs **alone**, with no time-slicing, both at once (they share nothing).
2. A local cluster starts (etcd, one orchestrator, one agent with ``--backend app``) and the
   same two jobs, same seeds, run **time-sliced** on one group: each generation and each
   training phase holds the group, and every switch offloads the holder's policy, reference
   model and optimizer state (:class:`~timeslice.offload.TorchOffloader`, storages at size 0
   while parked) and restores the next job's.
3. Per job, every logged loss, reward and KL, every parameter after every step and the final
   parameters must be **bit-identical** between the two runs. The first difference is named:
   job, step, tensor.

It prints each group's duty cycle (the fraction of the run some job held it), each job's time
alone and time-sliced, the switches and the bytes the agent moved, and a last line that says
whether training was identical; the exit status is 1 when it was not (2 when the demo itself
could not run). ``--corrupt grpo-b:3`` flips one bit of a parameter of job ``grpo-b`` right
after the grant of its step 3's training phase: the demo must report step 3 and that tensor.

On this CPU-only machine the "device" is host memory, so the switches move real bytes of real
training state, but at host memory speed; the GPU check (``scripts/gpu-check``) measures the
same offloader on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from timeslice_tools.dev import _procs
from timeslice_tools.dev.cluster import ClusterError, LocalCluster
from timeslice_tools.dev.etcd import EtcdError
from timeslice_tools.dev.timeline import Interval, duty_cycle

GROUP = "grpo-pool"
JOBS = (("grpo-a", 1), ("grpo-b", 2))
EXIT_NOT_IDENTICAL = 1
EXIT_DEMO_FAILED = 2
_JOB_MODULE = "timeslice_tools.dev.rl.job"


class DemoFailed(Exception):
    """The demo could not run (a job died, the cluster did not start, a deadline passed)."""


@dataclass(frozen=True)
class Difference:
    """The first place where a job's time-sliced training left its training alone."""

    job: str
    step: int  # 0: the final parameters
    what: str  # "loss", "reward", "kl", "steps", or the parameter's name
    alone: object
    sliced: object

    def __str__(self) -> str:
        where = "the final parameters" if self.step == 0 else f"step {self.step}"
        return (
            f"job {self.job}: {where}, {self.what} differs "
            f"(alone {_short(self.alone)}, time-sliced {_short(self.sliced)})"
        )


def _short(value: object) -> str:
    text = repr(value)
    return text[:19] + "..." if len(text) > 22 else text


def first_difference(
    job: str, alone: Mapping[str, Any], sliced: Mapping[str, Any]
) -> Difference | None:
    """The first step (then tensor) where two runs of ``job`` differ, or None: identical."""
    a_steps, s_steps = alone["steps"], sliced["steps"]
    for a, s in zip(a_steps, s_steps, strict=False):
        for key in ("loss", "reward", "kl"):
            if a.get(key) != s.get(key):
                return Difference(job, a["step"], key, a.get(key), s.get(key))
        for name, digest in a["params"].items():
            if s["params"].get(name) != digest:
                return Difference(job, a["step"], name, digest, s["params"].get(name))
    if len(a_steps) != len(s_steps):
        return Difference(job, 0, "steps", len(a_steps), len(s_steps))
    for name, digest in alone["final"].items():
        if sliced["final"].get(name) != digest:
            return Difference(job, 0, name, digest, sliced["final"].get(name))
    return None


@dataclass(frozen=True)
class Moves:
    """What the agent's journal says the switches moved."""

    checkpoints: int
    restores: int
    bytes_out: int
    bytes_in: int


def journal_moves(path: Path) -> Moves:
    """Count the agent's successful checkpoints and restores that moved bytes.

    The journal is JSON lines written by the agent (``timeslice_agent.journal``); read as
    data here, so the tools do not import the agent.
    """
    out = back = moved_out = moved_in = 0
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry.get("status") != "ok" or not entry.get("bytes_moved"):
                continue
            if entry.get("kind") == "checkpoint":
                out += 1
                moved_out += int(entry["bytes_moved"]) - int(entry.get("bytes_skipped", 0))
            elif entry.get("kind") == "restore":
                back += 1
                moved_in += int(entry["bytes_moved"])
    return Moves(out, back, moved_out, moved_in)


def group_duty(results: Sequence[Mapping[str, Any]]) -> tuple[float, Interval]:
    """The fraction of the time-sliced run during which some job held the group."""
    holds = [
        Interval(h["granted_at"], h["released_at"] or h["granted_at"])
        for r in results
        for h in r["holds"]
    ]
    if not holds:
        raise DemoFailed("the time-sliced jobs recorded no holds")
    window = Interval(min(h.start for h in holds), max(h.end for h in holds))
    return duty_cycle(holds, window), window


def _job_argv(job: str, seed: int, steps: int, run_dir: Path, extra: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-m", _JOB_MODULE, "--job-id", job, "--seed", str(seed),
        "--steps", str(steps), "--work", str(run_dir / job), "--out", str(run_dir / f"{job}.json"),
        *extra,
    ]  # fmt: skip


def _run_jobs(
    argvs: Mapping[str, list[str]],
    run_dir: Path,
    deadline: float,
    env: Mapping[str, str],
    job_env: Mapping[str, Mapping[str, str]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Start every job at once and wait for all; returns their result files' contents.
    ``job_env``: variables of one job's own (its certificate), by job."""
    run_dir.mkdir(parents=True, exist_ok=True)
    procs = {
        job: _procs.spawn(
            [*argv, "--barrier", str(run_dir)],
            run_dir / f"{job}.log",
            env={**env, **(job_env or {}).get(job, {})},
        )
        for job, argv in argvs.items()
    }
    try:
        # Both jobs import, build and register first; then they start together.
        while not all((run_dir / f"{job}.ready").exists() for job in argvs):
            dead = {job: p.poll() for job, p in procs.items() if p.poll() is not None}
            if dead:
                raise DemoFailed(f"jobs exited before they were ready: {dead} (logs in {run_dir})")
            if time.monotonic() > deadline:
                raise DemoFailed(f"the jobs were not ready in time (logs in {run_dir})")
            time.sleep(0.05)
        (run_dir / "go").touch()
        for job, proc in procs.items():
            try:
                code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log = run_dir / f"{job}.log"
                raise DemoFailed(f"job {job} did not finish in time (log: {log})") from None
            if code != 0:
                tail = (run_dir / f"{job}.log").read_text(errors="replace")[-2000:]
                raise DemoFailed(f"job {job} exited {code}:\n{tail}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    return {job: json.loads((run_dir / f"{job}.json").read_text()) for job in argvs}


@dataclass(frozen=True)
class Outcome:
    differences: dict[str, Difference | None]
    lines: list[str]

    @property
    def identical(self) -> bool:
        return all(d is None for d in self.differences.values())


def run_demo(
    steps: int,
    work: Path,
    out: TextIO,
    *,
    corrupt: tuple[str, int] | None = None,
    budget: float = 540.0,
) -> Outcome:
    """Run both jobs alone, then time-sliced, and compare (see the module docstring)."""
    deadline = time.monotonic() + budget
    say = _printer(out)
    say(f"timeslice demo-rl: 2 GRPO jobs (TRL GRPOTrainer, CPU), {steps} steps each")
    say(f"  work dir {work}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argvs = {job: _job_argv(job, seed, steps, work / "alone", []) for job, seed in JOBS}
    say("  1. each job alone, no time-slicing")
    alone = _run_jobs(argvs, work / "alone", deadline, env)
    cluster = LocalCluster(
        replicas=1,
        agents=1,
        backend="app",
        base_dir=work / "cluster",
        ready_timeout=min(60.0, max(5.0, deadline - time.monotonic())),
        tls=True,
    )
    try:
        cluster.start()
        env["TIMESLICE_TARGET"] = cluster.target
        # Each job with its own certificate (it may act as itself only).
        certs = {job: cluster.job_env(job) for job, _ in JOBS}
        socket = str(cluster.agent_sockets["node-0"])
        say(f"  2. both jobs time-sliced on group {GROUP} (agent --backend app, {cluster.target})")
        argvs = {}
        for job, seed in JOBS:
            extra = ["--group", GROUP, "--agent-socket", socket]
            if corrupt is not None and corrupt[0] == job:
                extra += ["--corrupt-step", str(corrupt[1])]
            argvs[job] = _job_argv(job, seed, steps, work / "sliced", extra)
        sliced = _run_jobs(argvs, work / "sliced", deadline, env, certs)
        moves = journal_moves(cluster.agent_journals["node-0"])
    finally:
        cluster.stop()
    if moves.checkpoints == 0:
        raise DemoFailed("no switch happened: the jobs never contended for the group")
    duty, window = group_duty(list(sliced.values()))
    say("")
    say(f"  group {GROUP}: duty cycle {duty:.0%} over {window.duration:.1f} s (held by some job)")
    for job, _ in JOBS:
        holds = sliced[job]["holds"]
        held = sum((h["released_at"] or h["granted_at"]) - h["granted_at"] for h in holds)
        restored = sum(1 for h in holds if h["restored"])
        parked = sliced[job]["parked_at_size_zero"]
        say(
            f"  {job}: alone {alone[job]['seconds']:.1f} s, time-sliced "
            f"{sliced[job]['seconds']:.1f} s; {len(holds)} holds ({held:.1f} s), "
            f"{restored} restores; state {sliced[job]['state_bytes'] / 2**20:.2f} MiB, "
            f"freed to size 0 at {sum(parked)} of {len(parked)} offloads"
        )
        if not all(parked):
            raise DemoFailed(f"job {job}: an offload left tracked storages allocated")
    say(
        f"  switches: {moves.checkpoints} checkpoints, {moves.restores} restores; bytes moved "
        f"out {moves.bytes_out / 2**20:.1f} MiB, in {moves.bytes_in / 2**20:.1f} MiB "
        "(CPU tensors: host memory copies)"
    )
    differences = {job: first_difference(job, alone[job], sliced[job]) for job, _ in JOBS}
    lines = []
    for job, _ in JOBS:
        found = differences[job]
        n = len(alone[job]["steps"])
        tensors = len(alone[job]["final"])
        line = (
            f"  {job}: {n} steps, loss, reward, KL and {tensors} parameters after every step "
            "bit-identical"
            if found is None
            else f"  MISMATCH {found}"
        )
        lines.append(line)
        say(line)
    outcome = Outcome(differences, lines)
    if outcome.identical:
        say("training identical: yes, both jobs trained bit for bit as they did alone")
    else:
        first = next(d for d in differences.values() if d is not None)
        say(f"training identical: NO ({first})")
    return outcome


def _printer(out: TextIO) -> Any:
    def say(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    return say


def _corrupt_arg(text: str) -> tuple[str, int]:
    job, _, step = text.partition(":")
    if job not in dict(JOBS) or not step.isdigit() or int(step) < 1:
        raise argparse.ArgumentTypeError(f"expected JOB:STEP with JOB in {[j for j, _ in JOBS]}")
    return job, int(step)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m timeslice_tools.dev.rl", description=__doc__)
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per job (default 100)")
    p.add_argument("--corrupt", type=_corrupt_arg, metavar="JOB:STEP", help="test switch")
    p.add_argument("--work", type=Path, help="work directory (default: a new temporary one)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole demo")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.corrupt is not None and args.corrupt[1] > args.steps:
        p.error("--corrupt's step must be within --steps")
    owns = args.work is None
    work = Path(tempfile.mkdtemp(prefix="timeslice-demo-rl-")) if owns else args.work
    try:
        outcome = run_demo(args.steps, work, sys.stdout, corrupt=args.corrupt, budget=args.budget)
    except (DemoFailed, ClusterError, EtcdError) as exc:
        print(f"demo-rl failed: {exc} (work dir kept: {work})", file=sys.stderr)
        return EXIT_DEMO_FAILED
    if owns and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if outcome.identical else EXIT_NOT_IDENTICAL
