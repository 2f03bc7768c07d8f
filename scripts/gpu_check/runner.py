"""One backend under test: a real cluster, two job processes, their figures.

:func:`run_backend` starts etcd, one orchestrator and one agent (``LocalCluster``) with the
backend's options, starts the two jobs (:mod:`scripts.gpu_check.job`), lets them switch the
group back and forth, and turns their events and the agent's journal into figures
(:mod:`scripts.gpu_check.analysis`) and a verdict (:mod:`scripts.gpu_check.verdict`). It never
raises for what the machine refuses (an agent that cannot start, a checkpoint the driver
rejects, a job that dies): those become the backend's ``findings``. Every wait has a deadline.

Jobs are judged by their result files, not their exit status. At the end every job process
still alive is stopped; under ``cuda`` on a GPU each is first locked and checkpointed
(:mod:`scripts.gpu_check.smoke` ``--park``), because killing a live restored process has hung
whole hosts (NVIDIA/cuda-checkpoint#53).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from scripts.gpu_check import REPO, analysis, verdict
from scripts.gpu_check.plan import PLAN_RATE
from scripts.gpu_check.protocol import (
    JobConfig,
    RunFiles,
    read_json,
    read_json_lines,
    write_json,
)
from timeslice import TimeSliceOrchestratorClient
from timeslice_tools.dev.cluster import ClusterError, LocalCluster
from timeslice_tools.dev.etcd import EtcdError

GROUP = "gpu-check"
NODE = "node-0"
MIB = 1024 * 1024
# Time kept at the end of a backend's slice for stopping jobs and services and copying logs.
TEARDOWN_SECONDS = 20.0
# Jobs that outlive their deadline by this much are killed.
KILL_GRACE_SECONDS = 10.0
KILL_WAIT_SECONDS = 5.0
# Parking a job (lock + checkpoint) moves its state at least this fast, plus the call overhead.
PARK_EXTRA_SECONDS = 30.0
LOG_TAIL_BYTES = 1 << 20
_POLL_SECONDS = 0.1


@dataclass(frozen=True)
class Settings:
    """The options every backend runs with (see :mod:`scripts.gpu_check.cli`)."""

    device: str
    size_bytes: int
    switches: int
    out: Path
    keep_pinned: bool
    app_residual_mib: int
    use_nvml: bool
    nvml_skip_reason: str = ""
    logs: Path = Path()  # where each backend's logs are staged for the archive
    corrupt_after_restore: bool = False

    def holds(self, index: int) -> int:
        """Holds of job ``index``: job 0 goes first, so ``switches + 1`` grants alternate and
        make exactly ``switches`` switches."""
        grants = self.switches + 1
        return math.ceil(grants / 2) if index == 0 else grants // 2


@dataclass(frozen=True)
class BackendSpec:
    """A backend under test: the agent's backend, its options, how jobs register."""

    name: str
    agent_backend: Literal["app", "cuda"]
    agent_args: tuple[str, ...] = ()
    description: str = ""


@dataclass
class Outcome:
    """What one backend run found; ``findings`` are the failures, in words."""

    name: str
    status: str = "failed"
    findings: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "findings": self.findings,
            "seconds": self.seconds,
            **self.figures,
        }


def _say(name: str, text: str) -> None:
    print(f"[gpu-check {name}] {text}", flush=True)


def _cluster_failure(exc: ClusterError) -> str:
    """``agent node-0 exited with status 2 ...: <the line that says why>``."""
    text = str(exc)
    head = text.split("; log", 1)[0].splitlines()[0]
    lines = [line.strip() for line in text.splitlines()[1:] if line.strip()]
    telling = [line for line in lines if "cannot start" in line or "Error" in line]
    why = (telling or lines or [""])[-1]
    return f"{head}: {why}" if why else head


def directive_timeout(slice_seconds: float) -> float:
    """The deadline of one checkpoint or restore directive (and of an app hook)."""
    # One move of one job's state must fit; a quarter of the slice leaves room for retries.
    return max(30.0, min(120.0, slice_seconds / 4))


def _make_cluster(
    settings: Settings, spec: BackendSpec, base: Path, slice_seconds: float
) -> LocalCluster:
    timeout = directive_timeout(slice_seconds)
    agent_args = ["--hook-timeout", f"{timeout:g}", *spec.agent_args]
    if spec.agent_backend == "app":
        agent_args += ["--app-residual-mib", str(settings.app_residual_mib)]
    return LocalCluster(
        backend=spec.agent_backend,
        base_dir=base,
        agent_args=agent_args,
        orchestrator_args=["--directive-timeout", f"{timeout:g}"],
        ready_timeout=min(60.0, max(10.0, slice_seconds / 4)),
        tls=True,  # a throw-away CA: every hop as a deployment runs it
    )


def _job_env(cluster: LocalCluster, job_id: str, socket: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(cluster.client_env)  # the cluster's CA and a client certificate
    path = [str(REPO), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env["PYTHONUNBUFFERED"] = "1"
    # The label the agent's foreign-process guard reads: this pid belongs to this job.
    env["TIMESLICE_JOB_ID"] = job_id
    env["TIMESLICE_AGENT_SOCKET"] = str(socket)
    return env


def _start_jobs(
    settings: Settings, spec: BackendSpec, cluster: LocalCluster, files: RunFiles, deadline: float
) -> list[subprocess.Popen[bytes]]:
    socket = cluster.agent_sockets[NODE]
    ids = [f"{spec.name}-job-{i}" for i in range(2)]
    procs = []
    for index in range(2):
        cfg = JobConfig(
            index=index, job_id=ids[index], peer_job_id=ids[1 - index], group=GROUP,
            backend=spec.agent_backend, device=settings.device, size_bytes=settings.size_bytes,
            holds=settings.holds(index), target=cluster.target, agent_socket=str(socket),
            run_dir=str(files.root), deadline=deadline, keep_pinned=settings.keep_pinned,
            use_nvml=settings.use_nvml, corrupt_after_restore=settings.corrupt_after_restore,
        )  # fmt: skip
        cfg.save(files.config(index))
        with files.log(index).open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "scripts.gpu_check.job", str(files.config(index))],
                    cwd=REPO,
                    env=_job_env(cluster, cfg.job_id, socket),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    return procs


def _job_failure(files: RunFiles, index: int, proc: subprocess.Popen[bytes]) -> str | None:
    """Why job ``index`` failed, judged by its result file; None when it succeeded."""
    if files.result(index).exists():
        result = read_json(files.result(index))
        return None if result.get("ok") else f"job {index}: {result.get('error', '')}"
    lines = files.log(index).read_text(errors="replace").strip().splitlines()
    reason = lines[-1] if lines else "no output"
    return f"job {index} wrote no result (exit status {proc.poll()}): {reason}"


def _wait_ready(
    procs: list[subprocess.Popen[bytes]], files: RunFiles, deadline: float
) -> str | None:
    """Wait for both jobs' ready files; the failure in words, or None."""
    while not all(files.ready(i).exists() for i in range(2)):
        for index, proc in enumerate(procs):
            if proc.poll() is not None and not files.ready(index).exists():
                return f"during setup: {_job_failure(files, index, proc)}"
        if time.time() >= deadline:
            return "deadline reached while the jobs were setting up"
        time.sleep(_POLL_SECONDS)
    return None


def _supervise(
    name: str,
    procs: list[subprocess.Popen[bytes]],
    files: RunFiles,
    cluster: LocalCluster,
    deadline: float,
    stall_seconds: float,
) -> list[str]:
    """Wait for both jobs' results; print each hold; stop on a stall or a dead service."""
    findings: list[str] = []
    seen = [0, 0]

    def report_new() -> bool:
        new = False
        for index in range(2):
            events = files.read_events(index)
            for event in events[seen[index] :]:
                _say(name, _describe(index, event))
                new = True
            seen[index] = len(events)
        return new

    def running(index: int) -> bool:
        return not files.result(index).exists() and procs[index].poll() is None

    last_progress = time.time()
    while running(0) or running(1):
        if report_new():
            last_progress = time.time()
        dead = cluster.exited()
        if dead:
            tails = {n: cluster.log_tail(n, 3).strip().splitlines()[-1:] for n in dead}
            findings.append(f"services exited during the run: {dead}; last log lines {tails}")
            break
        if time.time() >= deadline:
            findings.append(f"deadline reached with {sum(seen)} holds done")
            break
        if time.time() - last_progress > stall_seconds:
            findings.append(f"stalled: no grant for {stall_seconds:g} s ({sum(seen)} holds done)")
            break
        time.sleep(_POLL_SECONDS)
    report_new()
    return findings


def _describe(index: int, event: dict[str, Any]) -> str:
    text = f"job {index} hold {event['hold']}: "
    if event["switched"]:
        text += f"switched in ({event['orchestrator_switch_seconds']:.2f} s by the orchestrator)"
    else:
        text += "granted"
    if event.get("built"):
        text += f", built its state ({event['build_seconds']:.1f} s)"
    if event.get("corrupted"):
        text += f", self-test flipped {event['corrupted']}"
    text += f", every word {'ok' if event['checksum_ok'] else 'MISMATCH: ' + event['mismatch']}"
    out = event.get("adapter_offload")
    if out:
        text += f", out {out['copied_bytes'] / MIB:.0f} MiB copied"
        text += f" {out.get('skipped_bytes', 0) / MIB:.0f} MiB skipped"
    if "nvml_peer_bytes" in event:
        text += f", NVML own {event['nvml_own_bytes'] / MIB:.0f} MiB"
        text += f" peer {event['nvml_peer_bytes'] / MIB:.0f} MiB"
    return text


def _park(pids: list[int], job_bytes: int) -> list[str]:
    """Lock and checkpoint ``pids``, then kill them, in a child process with a deadline;
    findings, one per pid left alive (each names it as ``pid N``)."""
    timeout = len(pids) * (job_bytes / PLAN_RATE + PARK_EXTRA_SECONDS)
    argv = [sys.executable, "-m", "scripts.gpu_check.smoke", "--park", *map(str, pids)]
    try:
        done = subprocess.run(
            argv, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired:
        return [f"pid {pid} left alive, not killed: parking took over {timeout:.0f} s"
                for pid in pids]  # fmt: skip
    lines = done.stdout.strip().splitlines()
    try:
        answer = read_json_text(lines[-1])
    except (IndexError, ValueError):
        answer = {"error": f"no result: {(done.stdout + done.stderr)[-300:]}"}
    if "parked" not in answer:
        # Parking failed as a whole: none of them may be killed.
        return [f"pid {pid} left alive, not killed: {answer.get('error')}" for pid in pids]
    parked: dict[str, Any] = answer["parked"]
    return [
        f"pid {pid} left alive, not killed (cuda-checkpoint#53): {r.get('error')}"
        for pid, r in parked.items()
        if not r.get("killed") and r.get("error") != "gone"
    ]


def read_json_text(text: str) -> dict[str, Any]:
    value = json.loads(text)
    return value if isinstance(value, dict) else {}


def _end_jobs(
    settings: Settings, spec: BackendSpec, procs: list[subprocess.Popen[bytes]], grace: float
) -> list[str]:
    """Stop every job process still alive; what could not be stopped, in words.

    Jobs end themselves once their result is written, except under ``cuda`` on a GPU, where
    each live process is parked first and then killed (module docstring).
    """
    alive = [p for p in procs if p.poll() is None]
    stuck: list[str] = []
    if alive and spec.agent_backend == "cuda" and settings.device == "cuda":
        stuck += _park([p.pid for p in alive], settings.size_bytes)
    unparked = {word for line in stuck for word in line.split()[1:2]}
    end = time.time() + grace
    for index, proc in enumerate(procs):
        try:
            proc.wait(timeout=max(0.1, end - time.time()))
        except subprocess.TimeoutExpired:
            if str(proc.pid) in unparked:
                continue  # not parked: never SIGKILL a live restored process
            proc.kill()
            try:
                proc.wait(timeout=KILL_WAIT_SECONDS)
            except subprocess.TimeoutExpired:
                # Uninterruptible (a driver call?): leave it rather than blow the budget.
                stuck.append(f"job {index} (pid {proc.pid}) still alive after SIGKILL")
    return stuck


def _group_status(cluster: LocalCluster) -> dict[str, Any]:
    try:
        with TimeSliceOrchestratorClient(
            cluster.target, job_id="gpu-check-observer", call_timeout=5, **cluster.client_tls
        ) as client:
            status = client.status(GROUP)
    except Exception as exc:  # the orchestrator may be the thing that broke
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "switches": status.switches,
        "last_error": status.last_error,
        "faulted": [{"job": f.job_id, "reason": f.reason} for f in status.faulted],
    }


def _figures(
    settings: Settings, spec: BackendSpec, files: RunFiles, journal: list[dict[str, Any]]
) -> dict[str, Any]:
    events = [analysis.HoldEvent(i, e) for i in range(2) for e in files.read_events(i)]
    events.sort(key=lambda e: e["granted_at"])
    jobs = {f"{spec.name}-job-{i}" for i in range(2)}
    ready = [read_json(files.ready(i)) if files.ready(i).exists() else {} for i in range(2)]
    built = [read_json(files.built(i)) if files.built(i).exists() else {} for i in range(2)]
    notes = {r.get("nvml_note", "") for r in ready} - {""}
    skip = settings.nvml_skip_reason or "; ".join(sorted(notes))
    limit = settings.app_residual_mib * MIB if spec.agent_backend == "app" else 0
    figures: dict[str, Any] = {
        "switches": {
            "target": settings.switches,
            "observed": sum(1 for e in events if e["switched"]),
            "holds": len(events),
        },
        "checksums": analysis.checksums(events),
        "nvml": analysis.nvml_check(events, skipped=skip, limit_bytes=limit),
        "journal": analysis.journal_moves(journal, jobs),
        "per_switch": analysis.per_switch(journal, jobs),
        "switch_seen_by_waiter": analysis.switches_seen(events, journal, jobs),
        "jobs": [{**r, **b} for r, b in zip(ready, built, strict=True)],
    }
    if spec.agent_backend == "app":
        figures["adapter"] = analysis.adapter_cycles(events)
    return figures


def _judge(outcome: Outcome, settings: Settings) -> None:
    """Turn the figures into findings and a status (:mod:`scripts.gpu_check.verdict`)."""
    outcome.findings += verdict.findings(outcome.figures, switches=settings.switches)
    outcome.status = verdict.status(
        outcome.findings, outcome.figures["nvml"]["status"], device=settings.device
    )


def _keep_logs(cluster: LocalCluster, files: RunFiles, dest: Path) -> None:
    """Copy logs, journal and job records into ``dest`` (the tails of big logs), which the
    check archives into one file."""
    dest.mkdir(parents=True, exist_ok=True)
    sources = list(cluster.log_dir.glob("*.log")) if cluster.log_dir.exists() else []
    sources += [p for p in cluster.agent_journals.values() if p.exists()]
    if cluster.etcd is not None and cluster.etcd.log_path.exists():
        sources.append(cluster.etcd.log_path)
    sources += sorted(p for p in files.root.iterdir() if p.is_file())
    for source in sources:
        data = source.read_bytes()[-LOG_TAIL_BYTES:]
        (dest / source.name).write_bytes(data)


def _run_jobs(
    settings: Settings,
    spec: BackendSpec,
    cluster: LocalCluster,
    files: RunFiles,
    outcome: Outcome,
    deadline: float,
    stall_seconds: float,
) -> list[subprocess.Popen[bytes]]:
    """Start both jobs, release them together, wait for them; fills ``outcome``."""
    teardown = TEARDOWN_SECONDS
    if spec.agent_backend == "cuda" and settings.device == "cuda":
        teardown += settings.size_bytes / PLAN_RATE  # parking the last holder
    job_deadline = deadline - teardown
    procs = _start_jobs(settings, spec, cluster, files, job_deadline)
    failure = _wait_ready(procs, files, job_deadline)
    if failure is not None:
        outcome.findings.append(failure)
        return procs
    pids = {str(i): read_json(files.ready(i))["pid"] for i in range(2)}
    write_json(files.go, {"pids": pids})
    outcome.findings += _supervise(spec.name, procs, files, cluster, job_deadline, stall_seconds)
    outcome.findings += _end_jobs(settings, spec, procs, KILL_GRACE_SECONDS)
    outcome.findings += [
        failure for i, p in enumerate(procs) if (failure := _job_failure(files, i, p)) is not None
    ]
    journal = read_json_lines(cluster.agent_journals[NODE])
    outcome.figures = _figures(settings, spec, files, journal)
    outcome.figures["orchestrator_group_status"] = _group_status(cluster)
    _judge(outcome, settings)
    return procs


def run_backend(settings: Settings, spec: BackendSpec, deadline: float) -> Outcome:
    """Run ``spec`` until its jobs finish or ``deadline`` (wall clock); never raises for
    what the machine refuses."""
    started = time.time()
    outcome = Outcome(spec.name)
    slice_seconds = deadline - started
    _say(spec.name, f"starting ({slice_seconds:.0f} s budget)")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        files = RunFiles(Path(tmp) / "run")
        files.root.mkdir()
        cluster = _make_cluster(settings, spec, Path(tmp) / "cluster", slice_seconds)
        procs: list[subprocess.Popen[bytes]] = []
        try:
            cluster.start()
            # A switch is two directives; a stall is more than that without a grant.
            stall = 2 * directive_timeout(slice_seconds) + 30
            procs = _run_jobs(settings, spec, cluster, files, outcome, deadline, stall)
            outcome.figures["directive_timeout_seconds"] = directive_timeout(slice_seconds)
        except ClusterError as exc:
            outcome.findings.append(_cluster_failure(exc))
        except EtcdError as exc:
            outcome.findings.append(f"etcd did not start: {exc}")
        finally:
            # Only jobs the paths above did not stop are left (an exception on the way).
            outcome.findings += _end_jobs(settings, spec, procs, 0)
            if outcome.findings:
                outcome.status = verdict.FAILED
            cluster.stop()
            _keep_logs(cluster, files, settings.logs / spec.name)
            outcome.seconds = time.time() - started
            _say(spec.name, f"{outcome.status} in {outcome.seconds:.0f} s")
            for finding in outcome.findings:
                _say(spec.name, f"finding: {finding}")
    return outcome
