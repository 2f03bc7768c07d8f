"""Bare metal and Slurm: the systemd units and the Slurm prolog/epilog, run for real.

The prolog and epilog run as Slurm runs them (a bare environment with the ``SLURM_*`` variables
a prolog sees, a minimal ``PATH``), against a real orchestrator on a real etcd; the agent they
start is checked by a job that registers on its socket and acquires a group through it. The
systemd units are checked by ``systemd-analyze verify`` and by starting each unit's exact
``ExecStart`` with its ``EnvironmentFile`` (systemd itself is not PID 1 here).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient, register
from timeslice_tools.dev._procs import free_ports
from timeslice_tools.dev.certs import Pki

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "deploy" / "slurm"
SYSTEMD = ROOT / "deploy" / "systemd"
TIMESLICE_BIN = Path(sys.executable).parent / "timeslice"
NODE = "gpu-node-7"


def slurm_env(job_id: int, config: Path, state: Path, **extra: str) -> dict[str, str]:
    """What slurmd gives a prolog or epilog (no user environment, a minimal PATH)."""
    return {
        "PATH": "/usr/bin:/bin",
        "SLURM_JOB_ID": str(job_id),
        "SLURM_JOBID": str(job_id),
        "SLURM_JOB_USER": "root",
        "SLURM_JOB_UID": "0",
        "SLURM_JOB_GID": "0",
        "SLURM_JOB_PARTITION": "gpu",
        "SLURM_JOB_NODELIST": NODE,
        "SLURM_CLUSTER_NAME": "test",
        "SLURMD_NODENAME": NODE,
        "SLURM_SCRIPT_CONTEXT": "prolog_slurmd",
        "TIMESLICE_SLURM_CONFIG": str(config),
        "TIMESLICE_SLURM_STATE_DIR": str(state),
        "TIMESLICE_SLURM_LOG": str(state.parent / "agent.log"),
        "TIMESLICE_BIN": str(TIMESLICE_BIN),
        **extra,
    }


def run_script(
    name: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SLURM / name)], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def agent_env(pki: Pki, targets: str, tmp: Path, http_port: int) -> dict[str, str]:
    node = pki.node(NODE)
    return {
        "TIMESLICE_AGENT_ORCHESTRATOR": targets,
        "TIMESLICE_AGENT_BACKEND": "sim",
        "TIMESLICE_AGENT_SIM_STATE_GB": "0.1",
        "TIMESLICE_AGENT_WORKER_SOCKET": str(tmp / "agent.sock"),
        "TIMESLICE_AGENT_STATE_FILE": str(tmp / "agent.json"),
        "TIMESLICE_AGENT_HTTP": f"127.0.0.1:{http_port}",
        "TIMESLICE_AGENT_TLS_CA": str(pki.ca),
        "TIMESLICE_AGENT_TLS_CERT": str(node.cert),
        "TIMESLICE_AGENT_TLS_KEY": str(node.key),
    }


def write_env_file(path: Path, env: dict[str, str]) -> Path:
    path.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    return path


def pid_alive(pid: int) -> bool:
    """A live process (a zombie, reaped by nobody in a container, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(") ", 1)[-1][:1] not in ("Z", "X", "")


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


async def test_prolog_starts_one_agent_per_node_and_the_last_epilog_stops_it(
    cluster_factory: ClusterFactory, session_pki: Pki, tmp_path: Path
) -> None:
    cluster = cluster_factory(replicas=1, agents=0)
    (http_port,) = free_ports(1)
    env = agent_env(session_pki, ",".join(cluster.targets), tmp_path, http_port)
    config = write_env_file(tmp_path / "agent.env", env)
    state = tmp_path / "slurm"
    pid = 0
    try:
        first = run_script("timeslice-prolog", slurm_env(101, config, state))
        assert first.returncode == 0, first.stderr
        pid = int((state / "agent.pid").read_text())
        assert pid_alive(pid)
        # Ready means connected to the orchestrator, not just listening.
        assert http_status(f"http://127.0.0.1:{http_port}/readyz") == 200

        # A job of this allocation registers on the agent's socket and acquires through it.
        worker = register("g", job_id="j101", socket=env["TIMESLICE_AGENT_WORKER_SOCKET"])
        try:
            async with AsyncTimeSliceClient(cluster.targets, job_id="j101") as client:
                grant = await client.acquire("g", timeout=20)
                assert grant.job_id == "j101"
                status = await client.status("g")
                assert {n.node: n.resident_job_id for n in status.nodes} == {NODE: "j101"}
                await client.yield_("g")
        finally:
            worker.close()

        # A second job on the node finds the agent running: no second agent.
        second = run_script("timeslice-prolog", slurm_env(102, config, state))
        assert second.returncode == 0, second.stderr
        assert "already running" in second.stderr
        assert int((state / "agent.pid").read_text()) == pid
        assert sorted(p.name for p in (state / "jobs").iterdir()) == ["101", "102"]

        # The first job ends: the other still uses the agent.
        ended = run_script("timeslice-epilog", slurm_env(101, config, state))
        assert ended.returncode == 0, ended.stderr
        assert pid_alive(pid)
        # The last one ends: the agent stops, on SIGTERM, well within its stop timeout.
        started = time.monotonic()
        last = run_script("timeslice-epilog", slurm_env(102, config, state))
        assert last.returncode == 0, last.stderr
        # The epilog sees the agent gone once its memory is (an empty cmdline); the kernel
        # finishes its exit a moment later (seen still running once on a loaded machine).
        gone_by = time.monotonic() + 5
        while pid_alive(pid):
            assert time.monotonic() < gone_by, "the agent outlived the epilog"
            await asyncio.sleep(0.01)
        assert time.monotonic() - started < 20
        assert "killing" not in last.stderr, "stopped by SIGTERM, not SIGKILL"
        assert not (state / "agent.pid").exists()
        assert list((state / "jobs").iterdir()) == []
        # An epilog of a job the node never saw changes nothing and succeeds.
        assert run_script("timeslice-epilog", slurm_env(103, config, state)).returncode == 0
    finally:
        if pid and pid_alive(pid):
            os.kill(pid, 9)


def test_prolog_fails_and_cleans_up_when_the_agent_cannot_connect(
    session_pki: Pki, tmp_path: Path
) -> None:
    (http_port, dead_port) = free_ports(2)
    env = agent_env(session_pki, f"127.0.0.1:{dead_port}", tmp_path, http_port)
    config = write_env_file(tmp_path / "agent.env", env)
    state = tmp_path / "slurm"
    # Long enough for the agent to start and log why it cannot connect, even on a loaded
    # machine (3 s once left its log empty: the interpreter had not started yet).
    extra = {"TIMESLICE_SLURM_START_TIMEOUT": "10"}
    result = run_script("timeslice-prolog", slurm_env(201, config, state, **extra))
    # Non-zero: Slurm drains the node and requeues the job, as for any failed prolog.
    assert result.returncode == 1
    assert "not ready after 10s" in result.stderr
    assert not (state / "agent.pid").exists()
    assert list((state / "jobs").iterdir()) == []
    log = (tmp_path / "agent.log").read_text()
    assert "agent" in log  # the agent's own log says why (kept for the operator)


def test_prolog_and_epilog_do_nothing_off_timeslice_nodes_and_jobs(
    session_pki: Pki, tmp_path: Path
) -> None:
    state = tmp_path / "slurm"
    missing = tmp_path / "no-such.env"
    for script in ("timeslice-prolog", "timeslice-epilog"):
        result = run_script(script, slurm_env(301, missing, state))
        assert result.returncode == 0, result.stderr
    assert not state.exists()
    # A job without the configured feature is left alone on a timeslice node.
    (http_port,) = free_ports(1)
    env = agent_env(session_pki, "x:1", tmp_path, http_port)
    config = write_env_file(tmp_path / "agent.env", env)
    extra = {"TIMESLICE_SLURM_CONSTRAINT": "timeslice", "SLURM_JOB_CONSTRAINTS": "a100&ib"}
    result = run_script("timeslice-prolog", slurm_env(302, config, state, **extra))
    assert result.returncode == 0, result.stderr
    assert not state.exists()
    # Without SLURM_JOB_ID it is not a Slurm prolog: a clear error.
    bare = {k: v for k, v in slurm_env(303, config, state).items() if k != "SLURM_JOB_ID"}
    result = run_script("timeslice-prolog", bare)
    assert result.returncode != 0 and "SLURM_JOB_ID" in result.stderr


def unit_settings(unit: Path) -> dict[str, str]:
    settings: dict[str, str] = {}
    for line in unit.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings[key.strip()] = value.strip()
    return settings


@pytest.mark.parametrize("service", ["orchestrator", "agent"])
def test_systemd_units_verify(service: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # The unit as installed, with its paths pointed at this checkout (verify checks they exist).
    unit = (SYSTEMD / f"timeslice-{service}.service").read_text()
    unit = unit.replace("/usr/local/bin/timeslice", str(TIMESLICE_BIN))
    unit = unit.replace(f"/etc/timeslice/{service}.env", str(SYSTEMD / f"{service}.env.example"))
    path = tmp_path / f"timeslice-{service}.service"
    path.write_text(unit)
    result = subprocess.run(
        [analyze, "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Messages about this machine's own units (no systemd as PID 1) are not ours.
    ours = [line for line in result.stderr.splitlines() if path.name in line]
    assert ours == [], result.stderr


def parse_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    return env


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while http_status(url) != 200:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{url} not ready after {timeout} s"
        time.sleep(0.1)


async def test_systemd_exec_start_runs_both_services(
    tls_etcd_server: object, session_pki: Pki, tmp_path: Path
) -> None:
    """Each unit's ExecStart with an EnvironmentFile shaped like its example, for real: the
    orchestrator on the TLS etcd, the agent connected to it, a job served through both."""
    from timeslice_tools.dev.etcd import EtcdServer

    assert isinstance(tls_etcd_server, EtcdServer)
    grpc_port, orch_http, agent_http = free_ports(3)
    orchestrator_pki = session_pki.orchestrator
    etcd_client = session_pki.etcd_client
    example = parse_env_file(SYSTEMD / "orchestrator.env.example")
    orchestrator_env = {
        **example,
        "TIMESLICE_ORCHESTRATOR_LISTEN": f"127.0.0.1:{grpc_port}",
        "TIMESLICE_ORCHESTRATOR_HTTP": f"127.0.0.1:{orch_http}",
        "TIMESLICE_ORCHESTRATOR_ETCD": tls_etcd_server.endpoint,
        "TIMESLICE_ORCHESTRATOR_ETCD_CA": str(session_pki.etcd_ca),
        "TIMESLICE_ORCHESTRATOR_ETCD_CERT": str(etcd_client.cert),
        "TIMESLICE_ORCHESTRATOR_ETCD_KEY": str(etcd_client.key),
        "TIMESLICE_ORCHESTRATOR_TLS_CA": str(session_pki.ca),
        "TIMESLICE_ORCHESTRATOR_TLS_CERT": str(orchestrator_pki.cert),
        "TIMESLICE_ORCHESTRATOR_TLS_KEY": str(orchestrator_pki.key),
        "TIMESLICE_ORCHESTRATOR_PREFIX": f"/timeslice/systemd-{tmp_path.name}",
    }
    assert example.keys() <= orchestrator_env.keys()
    agent_example = parse_env_file(SYSTEMD / "agent.env.example")
    agent = {
        **agent_example,
        **agent_env(session_pki, f"127.0.0.1:{grpc_port}", tmp_path, agent_http),
        "TIMESLICE_AGENT_WORKER_SOCKET_GROUP": str(os.getgid()),
        "TIMESLICE_AGENT_BACKEND": "sim",
        "TIMESLICE_AGENT_NODE": NODE,
    }
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for service, env in (("orchestrator", orchestrator_env), ("agent", agent)):
            exec_start = unit_settings(SYSTEMD / f"timeslice-{service}.service")["ExecStart"]
            argv = exec_start.replace("/usr/local/bin/timeslice", str(TIMESLICE_BIN)).split()
            log = (tmp_path / f"{service}.log").open("wb")
            procs.append(
                subprocess.Popen(argv, env={"PATH": "/usr/bin:/bin", **env}, stdout=log, stderr=log)
            )
            port = orch_http if service == "orchestrator" else agent_http
            wait_ready(f"http://127.0.0.1:{port}/readyz", procs[-1])
        worker = register("g", job_id="sd", socket=agent["TIMESLICE_AGENT_WORKER_SOCKET"])
        try:
            async with AsyncTimeSliceClient(f"127.0.0.1:{grpc_port}", job_id="sd") as client:
                await client.acquire("g", timeout=20)
                status = await client.status("g")
                assert {n.node: n.resident_job_id for n in status.nodes} == {NODE: "sd"}
                await client.yield_("g")
        finally:
            worker.close()
        # SIGTERM (the units' KillSignal) stops both cleanly within TimeoutStopSec.
        for proc in reversed(procs):
            proc.terminate()
            assert proc.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _prolog_function(name: str) -> str:
    """One shell function of the prolog, as its text (to run it on its own)."""
    text = (SLURM / "timeslice-prolog").read_text()
    start = text.index(f"{name}() {{")
    return text[start : text.index("\n}\n", start) + 3]


def test_the_prolog_tells_a_live_agent_from_a_dead_one_by_its_process_state(
    tmp_path: Path,
) -> None:
    """The prolog's liveness check reads the process state, not the command line: the command
    line reads empty for a moment while a process execs (the agent's start execs three
    times), and a loaded CI machine once saw a starting agent as exited. A zombie, or no
    process, is dead."""
    alive = _prolog_function("alive")
    live = subprocess.Popen(["sleep", "30"])
    zombie = subprocess.Popen(["true"])
    try:
        deadline = time.monotonic() + 10
        while pid_alive(zombie.pid):
            assert time.monotonic() < deadline, "the child never exited"
            time.sleep(0.01)
        gone = subprocess.Popen(["true"])
        gone.wait()
        # A command name with spaces and parentheses does not confuse it.
        odd = tmp_path / "a (b) c"
        shutil.copy("/bin/sleep", odd)
        oddly_named = subprocess.Popen([str(odd), "30"])
        try:
            for pid, expected in (
                (live.pid, 0),
                (oddly_named.pid, 0),
                (zombie.pid, 1),
                (gone.pid, 1),
            ):
                code = subprocess.run(["bash", "-c", f"{alive}\nalive {pid}"], check=False)
                assert pid_alive(pid) is (expected == 0), pid
                assert code.returncode == expected, (pid, expected)
        finally:
            oddly_named.kill()
            oddly_named.wait()
    finally:
        live.kill()
        live.wait()
        zombie.wait()
