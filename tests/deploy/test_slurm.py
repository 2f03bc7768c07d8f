"""Slurm: two sbatch jobs on the same GPU, time-sliced, with deploy/slurm as it ships.

A real one-node Slurm (Debian's slurm-wlm and munge: munged, slurmctld, slurmd as root in the
foreground, tests.deploy.slurm_node) runs deploy/slurm/timeslice-prolog, -epilog and
-taskprolog, and two jobs of deploy/slurm/rl-job.sbatch, each ``--gres=shard:1`` of the node's
one GPU (a fake character device), against a real orchestrator on a real etcd, with mutual TLS:
the TaskProlog gives each job its job id, group, orchestrator and job certificate. The jobs run
at once on the node and hold the group in turns, never together.

The TaskProlog is also checked alone, with the environment slurmstepd gives it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ClusterFactory
from tests.deploy.slurm_node import NODE, SlurmNode, missing_binaries
from timeslice import AsyncTimeSliceClient
from timeslice_orchestrator.visibility import OTHER_JOB
from timeslice_tools.dev._procs import free_ports
from timeslice_tools.dev.certs import Pki

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm"
TIMESLICE_BIN = Path(sys.executable).parent / "timeslice"
JOBS = ("rl-job-a", "rl-job-b")
STEPS = 4
GROUP = f"slurm-{NODE}"  # the TaskProlog's default: jobs on the same nodes share a group

HOLD = re.compile(
    r"hold job=(?P<job>\S+) step=(?P<step>\d+) start=(?P<start>[\d.]+) end=(?P<end>[\d.]+) "
    r"epoch=(?P<epoch>\d+) restored=(?P<restored>\w+) previous=(?P<previous>\(other job\)|\S+)"
)


@dataclass(frozen=True)
class Hold:
    job: str
    start: float
    end: float
    restored: bool
    previous: str


def holds_of(text: str) -> list[Hold]:
    return [
        Hold(m["job"], float(m["start"]), float(m["end"]), m["restored"] == "True", m["previous"])
        for m in HOLD.finditer(text)
    ]


# -- the real thing --------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.skipif(
    bool(missing_binaries()),
    reason=f"Slurm or munge is not installed (missing: {' '.join(missing_binaries())}; "
    "Debian: apt-get install slurm-wlm munge)",
)
@pytest.mark.skipif(os.geteuid() != 0, reason="slurmd and munged run as root")
def test_two_sbatch_jobs_share_the_gpu_and_take_turns(
    cluster_factory: ClusterFactory, session_pki: Pki, tmp_path: Path
) -> None:
    cluster = cluster_factory(replicas=1, agents=0)
    (http_port,) = free_ports(1)
    node = session_pki.node(NODE)
    # The job certificates, each readable by its job's user only (here both are root's).
    certs = tmp_path / "jobs"
    certs.mkdir()
    for job in JOBS:
        pair = session_pki.job(job)
        shutil.copy(pair.cert, certs / pair.cert.name)
        shutil.copy(pair.key, certs / pair.key.name)
    agent_dir = tmp_path / "agent"
    agent_dir.mkdir()
    config = tmp_path / "agent.env"
    config.write_text(
        "".join(
            f"{k}={v}\n"
            for k, v in {
                "TIMESLICE_AGENT_ORCHESTRATOR": ",".join(cluster.targets),
                "TIMESLICE_AGENT_BACKEND": "sim",
                "TIMESLICE_AGENT_SIM_STATE_GB": "0.1",
                "TIMESLICE_AGENT_WORKER_SOCKET": str(agent_dir / "agent.sock"),
                "TIMESLICE_AGENT_STATE_FILE": str(agent_dir / "agent.json"),
                "TIMESLICE_AGENT_HTTP": f"127.0.0.1:{http_port}",
                "TIMESLICE_AGENT_TLS_CA": str(session_pki.ca),
                "TIMESLICE_AGENT_TLS_CERT": str(node.cert),
                "TIMESLICE_AGENT_TLS_KEY": str(node.key),
                "TIMESLICE_SLURM_JOB_CERTS": str(certs),
            }.items()
        )
    )
    state = tmp_path / "state"
    scripts = {
        "Prolog": SLURM / "timeslice-prolog",
        "Epilog": SLURM / "timeslice-epilog",
        "TaskProlog": SLURM / "timeslice-taskprolog",
    }
    script_env = {
        "TIMESLICE_SLURM_CONFIG": str(config),
        "TIMESLICE_SLURM_STATE_DIR": str(state),
        "TIMESLICE_SLURM_LOG": str(tmp_path / "agent-slurm.log"),
        "TIMESLICE_BIN": str(TIMESLICE_BIN),
    }
    out = tmp_path / "out"
    out.mkdir()
    started = time.monotonic()
    with SlurmNode(scripts, script_env) as slurm:
        up = time.monotonic() - started

        async def gate_then_submit() -> None:
            """Hold the group (as the operator) until both jobs wait in its queue, so that
            their turns start together whatever each one's start-up time."""
            async with AsyncTimeSliceClient(cluster.target, job_id="gate") as operator:
                await operator.acquire(GROUP, timeout=20)
                for job in JOBS:
                    submitted.append(
                        slurm.sbatch(
                            SLURM / "rl-job.sbatch",
                            f"--output={out}/%j.out",
                            f"--chdir={out}",
                            env={
                                "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
                                "HOME": str(tmp_path),
                                "PYTHON": sys.executable,
                                "TIMESLICE_JOB_ID": job,
                                "RL_STEPS": str(STEPS),
                                "RL_GPU_SECONDS": "0.4",
                                "RL_CPU_SECONDS": "0.1",
                            },
                        )
                    )
                deadline = time.monotonic() + 60
                while True:
                    status = await operator.status(GROUP)
                    if {e.job_id for e in status.queue} >= set(JOBS):
                        break
                    assert time.monotonic() < deadline, (
                        f"the jobs never queued: {status}\n{slurm.logs()}\n{read_outputs(out)}"
                    )
                    await asyncio.sleep(0.1)
                # Both in the queue: both jobs are running on the node at this moment.
                states = slurm.jobs()
                assert [states.get(j) for j in submitted] == ["RUNNING", "RUNNING"], states
                await operator.yield_(GROUP)

        submitted: list[int] = []
        asyncio.run(gate_then_submit())
        # Each job holds a shard of the same GPU: Slurm gave both the same device.
        gres = [slurm.job_field(j, "TresPerNode") for j in submitted]
        assert gres == ["gres:shard:1", "gres:shard:1"], gres

        deadline = time.monotonic() + 90
        while slurm.jobs():
            assert time.monotonic() < deadline, f"{slurm.jobs()}\n{slurm.logs()}"
            time.sleep(0.2)
        text = read_outputs(out)
        prolog_agent_stopped = not (state / "agent.pid").exists()
        markers = sorted(p.name for p in (state / "jobs").iterdir())

    # Both jobs ran to the end, on the same GPU, as the TaskProlog told them.
    for job in JOBS:
        assert f"done job={job}" in text, text
        assert f"timeslice job {job}, group {GROUP}, GPUs 0" in text, text
    holds = sorted(holds_of(text), key=lambda h: h.start)
    assert sorted(h.job for h in holds) == sorted(JOBS * STEPS), text
    # Time-sliced: never two holders at once, and turns alternate (each yields while the other
    # waits), every hand-over a switch on the node that brought the incoming job's state back.
    # (A job's first grant restores nothing: its state was never moved off.)
    firsts = {job: min(h.start for h in holds if h.job == job) for job in JOBS}
    for before, after in itertools.pairwise(holds):
        assert before.end <= after.start, (before, after)
        assert before.job != after.job, (before, after)
        # Each job has a certificate of its own: it reads the job it took over from as
        # another tenant, never by name (docs/security.md, Reads).
        assert after.previous == OTHER_JOB, (before, after)
        assert after.restored or after.start == firsts[after.job], (before, after)

    async def usage() -> dict[str, int]:
        async with AsyncTimeSliceClient(cluster.target, job_id="gate") as operator:
            status = await operator.status(GROUP)
        assert status.switches >= 2 * STEPS - 1, status
        return {u.job_id: int(u.holds) for u in status.usage}

    held = asyncio.run(usage())
    assert {job: held.get(job) for job in JOBS} == dict.fromkeys(JOBS, STEPS), held
    # The last job's epilog stopped the agent the first job's prolog started.
    assert prolog_agent_stopped and markers == [], (markers, text)
    elapsed = time.monotonic() - started
    print(f"slurm up in {up:.1f}s, whole test {elapsed:.1f}s")
    for hold in holds:
        print(hold)


def read_outputs(out: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(out.glob("*.out")))


# -- the TaskProlog alone ---------------------------------------------------------------------


def task_env(state: Path, **extra: str) -> dict[str, str]:
    """What slurmstepd gives a TaskProlog: the job's environment and the task's SLURM_*."""
    return {
        "PATH": "/usr/bin:/bin",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_USER": "root",
        "SLURM_JOB_NODELIST": "gpu-[1-2]",
        "SLURMD_NODENAME": "gpu-1",
        "SLURM_SCRIPT_CONTEXT": "prolog_task",
        "TIMESLICE_SLURM_STATE_DIR": str(state),
        **extra,
    }


def run_taskprolog(env: dict[str, str]) -> dict[str, str | list[str]]:
    result = subprocess.run(
        [str(SLURM / "timeslice-taskprolog")],
        env=env,
        capture_output=True,
        text=True,
        timeout=20,
        check=False,
    )
    assert result.returncode == 0, result.stderr  # it never fails a task
    exports: dict[str, str | list[str]] = {}
    prints: list[str] = []
    for line in result.stdout.splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            exports[name] = value
        else:
            assert line.startswith("print "), line  # all Slurm understands
            prints.append(line.removeprefix("print "))
    exports["print"] = prints
    return exports


def write_task_state(state: Path, certs: Path, **settings: str) -> None:
    (state / "jobs").mkdir(parents=True)
    values = {
        "TIMESLICE_TARGET": "orch-0:50051,orch-1:50051",
        "TIMESLICE_TLS_CA": "/etc/timeslice/pki/ca.crt",
        "TIMESLICE_INSECURE": "",
        "TIMESLICE_AGENT_SOCKET": "/run/timeslice/agent.sock",
        "TIMESLICE_SLURM_GROUP": "",
        "TIMESLICE_SLURM_JOB_CERTS": str(certs),
        **settings,
    }
    (state / "task.env").write_text("".join(f"{k}={v}\n" for k, v in values.items()))


def test_the_taskprolog_gives_a_task_its_job_group_orchestrator_and_certificate(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    certs = tmp_path / "certs-root"
    certs.mkdir()
    for name in ("job-rl-job-a.crt", "job-rl-job-a.key"):
        (certs / name).write_text("pem\n")
    write_task_state(state, tmp_path / "certs-%u")

    # A job whose prolog did not run here (no marker: not a timeslice job) gets nothing.
    assert run_taskprolog(task_env(state, TIMESLICE_JOB_ID="rl-job-a")) == {"print": []}

    (state / "jobs" / "42").touch()
    got = run_taskprolog(task_env(state, TIMESLICE_JOB_ID="rl-job-a"))
    assert got == {
        "TIMESLICE_JOB_ID": "rl-job-a",
        # Jobs on the same node set share a group; '[' ']' cannot be in a group id.
        "TIMESLICE_GROUP": "slurm-gpu-_1-2_",
        "TIMESLICE_TARGET": "orch-0:50051,orch-1:50051",
        "TIMESLICE_TLS_CA": "/etc/timeslice/pki/ca.crt",
        "TIMESLICE_AGENT_SOCKET": "/run/timeslice/agent.sock",
        # %u is the job's user.
        "TIMESLICE_TLS_CERT": f"{certs}/job-rl-job-a.crt",
        "TIMESLICE_TLS_KEY": f"{certs}/job-rl-job-a.key",
        "print": [],
    }

    # Without a job id of its own the Slurm job id names it; no certificate for that job: it
    # says so in the job's output and exports no certificate.
    got = run_taskprolog(task_env(state, TIMESLICE_GROUP="trainers"))
    assert got["TIMESLICE_JOB_ID"] == "slurm-42" and got["TIMESLICE_GROUP"] == "trainers"
    assert "TIMESLICE_TLS_CERT" not in got
    assert any("no job certificate for slurm-42" in line for line in got["print"]), got

    # What the job was submitted with wins: its own orchestrator and certificate.
    got = run_taskprolog(
        task_env(
            state,
            TIMESLICE_JOB_ID="rl-job-a",
            TIMESLICE_TARGET="other:50051",
            TIMESLICE_TLS_CERT="/home/me/job.crt",
        )
    )
    assert "TIMESLICE_TARGET" not in got and "TIMESLICE_TLS_CERT" not in got, got
    assert got["TIMESLICE_TLS_CA"] == "/etc/timeslice/pki/ca.crt"

    # An id the SDK would refuse is refused here, in words, and nothing is exported.
    got = run_taskprolog(task_env(state, TIMESLICE_JOB_ID="../etc"))
    assert set(got) == {"print"} and "not a valid job id" in str(got["print"]), got


def test_the_taskprolog_follows_the_node_config_for_the_group_and_plaintext(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    write_task_state(state, tmp_path, TIMESLICE_SLURM_GROUP="rack-7", TIMESLICE_INSECURE="1")
    (state / "jobs" / "42").touch()
    got = run_taskprolog(task_env(state))
    assert got["TIMESLICE_GROUP"] == "rack-7"
    assert got["TIMESLICE_INSECURE"] == "1" and "TIMESLICE_TLS_CERT" not in got, got
    assert got["print"] == []
    # A node whose prolog wrote no settings: the job is told, and the task still starts.
    (state / "task.env").unlink()
    got = run_taskprolog(task_env(state))
    assert set(got) == {"print"} and "task.env" in str(got["print"]), got
