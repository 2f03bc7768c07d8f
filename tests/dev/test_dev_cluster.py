"""LocalCluster and ``timeslice dev cluster``: real etcd, orchestrators and agents on loopback."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from timeslice.tls import CA_ENV, CERT_ENV, KEY_ENV
from timeslice_tools.dev import _procs
from timeslice_tools.dev.certs import Pki
from timeslice_tools.dev.cluster import ClusterError, LocalCluster
from timeslice_tools.dev.etcd import EtcdServer


def processes_mentioning(marker: str) -> list[int]:
    """PIDs of live (non-zombie) processes whose command line contains ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def ready(address: str) -> bool:
    answer = _procs.http_status(f"http://{address}/readyz", timeout=2)
    return answer is not None and answer[0] == 200


def test_cluster_lifecycle_and_fault_injection() -> None:
    cluster = LocalCluster(replicas=2, agents=2)
    base_dir = cluster.base_dir
    with cluster:
        assert cluster.replica_ids == ["r0", "r1"]
        assert cluster.nodes == ["node-0", "node-1"]
        assert len(cluster.targets) == 2
        assert cluster.target == ",".join(cluster.targets)
        assert all(t.startswith("127.0.0.1:") for t in cluster.targets)
        assert cluster.prefix.startswith("/timeslice/dev-")
        assert all(ready(h) for h in cluster.replica_http)
        assert all(ready(h) for h in cluster.agent_http.values())
        assert all(p.exists() for p in cluster.agent_sockets.values())
        assert set(cluster.processes) == {"r0", "r1", "node-0", "node-1", "etcd"}
        pids = [p.pid for p in cluster.processes.values()]

        old = cluster.processes["r0"]
        cluster.kill_replica(0)
        assert old.returncode == -signal.SIGKILL
        assert cluster.exited() == {"r0": -signal.SIGKILL}
        with pytest.raises(ClusterError, match="still running"):
            cluster.start_replica(1)
        cluster.start_replica(0)
        assert cluster.processes["r0"].pid != old.pid
        assert ready(cluster.replica_http[0])

        cluster.kill_agent("node-1")
        assert not ready(cluster.agent_http["node-1"])
        cluster.start_agent("node-1")
        assert ready(cluster.agent_http["node-1"])
        assert "starting:" in cluster.log_tail("node-1")
        assert cluster.exited() == {}

        with pytest.raises(IndexError):
            cluster.kill_replica(2)
        with pytest.raises(KeyError, match="node-9"):
            cluster.kill_agent("node-9")
        pids += [p.pid for p in cluster.processes.values()]
    assert [pid for pid in pids if alive(pid)] == []
    assert processes_mentioning(str(base_dir)) == []
    assert not base_dir.exists()
    cluster.stop()  # idempotent


def test_given_etcd_and_base_dir_are_left_alone(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "etcd") as etcd:
        with LocalCluster(
            etcd_endpoint=etcd.endpoint, agents=1, base_dir=tmp_path / "c", prefix="/timeslice/t1"
        ) as cluster:
            assert cluster.etcd is None
            assert cluster.etcd_endpoint == etcd.endpoint
            assert "etcd" not in cluster.processes
            assert (
                cluster.agent_sockets["node-0"]
                == tmp_path / "c" / "agents" / "node-0" / "worker.sock"
            )
        assert etcd.is_running()
        assert (tmp_path / "c" / "logs" / "r0.log").exists()
        assert (tmp_path / "c" / "logs" / "node-0.log").exists()
    assert processes_mentioning(str(tmp_path)) == []


def test_a_deep_base_dir_gets_short_socket_paths(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 40)
    cluster = LocalCluster(agents=1, base_dir=deep)
    try:
        socket_path = cluster.agent_sockets["node-0"]
        assert len(str(socket_path)) < 100
        assert not str(socket_path).startswith(str(deep))
        socket_dir = socket_path.parent.parent
        assert socket_dir.exists()
    finally:
        cluster.stop()
    assert not socket_dir.exists()


def test_a_service_that_fails_to_start_raises_with_its_log(tmp_path: Path) -> None:
    cluster = LocalCluster(agents=0, base_dir=tmp_path, orchestrator_args=["--no-such-flag"])
    with pytest.raises(ClusterError) as info:
        cluster.start()
    message = str(info.value)
    assert "orchestrator r0 exited with status 2 before it was ready" in message
    assert "--no-such-flag" in message
    # Everything started so far (the private etcd) was stopped.
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"replicas": 0},
        {"agents": -1},
        {"backend": "tpu"},
        {"session_ttl": 0},
        {"prefix": "no-slash"},
        {"prefix": "/a/../b"},
        {"prefix": "/ends/"},
    ],
)
def test_bad_parameters_are_refused_before_anything_starts(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LocalCluster(**kwargs)  # type: ignore[arg-type]


def _read_lines(stream: object, lines: queue.Queue[str | None]) -> None:
    assert hasattr(stream, "readline")
    for line in iter(stream.readline, ""):
        lines.put(line.rstrip("\n"))
    lines.put(None)


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_dev_cluster_command_ready_then_clean_stop(
    tmp_path: Path, stop_signal: int, session_pki: Pki
) -> None:
    base_dir = tmp_path / "cluster"
    prefix = f"/timeslice/cli-test-{os.getpid()}-{int(stop_signal)}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "timeslice_tools.cli", "dev", "cluster", "--replicas", "2",
         "--agents", "1", "--base-dir", str(base_dir), "--prefix", prefix,
         "--certs", str(session_pki.directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_read_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        started = time.monotonic()
        first = lines.get(timeout=30)
        assert first is not None and first.startswith("ready "), first
        assert time.monotonic() - started < 30
        targets = first.removeprefix("ready ").split(",")
        assert len(targets) == 2
        info: list[str] = []
        while not info or not info[-1].startswith("stop with"):
            line = lines.get(timeout=10)
            assert line is not None
            info.append(line)
        assert f"export TIMESLICE_TARGET={','.join(targets)}" in info
        assert f"export {CA_ENV}={session_pki.ca}" in info
        sockets = [line for line in info if "TIMESLICE_AGENT_SOCKET=" in line]
        assert len(sockets) == 1
        assert sockets[0].startswith("agent node-0: export TIMESLICE_AGENT_SOCKET=")
        # Under base_dir, or in a short /tmp directory when base_dir is too deep for sun_path.
        socket_path = Path(sockets[0].split("=", 1)[1])
        assert socket_path.is_socket()
        assert any(line.startswith("etcd 127.0.0.1:") and prefix in line for line in info)
        assert f"logs {base_dir / 'logs'}" in info
        # Each replica's dashboard, printed and in the replica's start log, serves the page.
        dashboards = dict(
            line.removeprefix("dashboard ").split(": ", 1)
            for line in info
            if line.startswith("dashboard ")
        )
        assert set(dashboards) == {"r0", "r1"}, info
        for replica, url in dashboards.items():
            assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", url), url
            page = urllib.request.urlopen(url, timeout=10).read()
            assert b"<title>timeslice dashboard</title>" in page
            start_log = (base_dir / "logs" / f"{replica}.log").read_text()
            assert f"dashboard at {url}" in start_log, start_log[-2000:]
        pid_line = next(line for line in info if line.startswith("pids "))
        pids = {k: int(v) for k, v in (kv.split("=") for kv in pid_line.split()[1:])}
        assert set(pids) == {"etcd", "r0", "r1", "node-0"}

        # Clients get a certificate per job, and the operator's for operator commands.
        exports = {
            line.partition(": export ")[0]: dict(
                kv.split("=", 1) for kv in line.partition(": export ")[2].split()
            )
            for line in info
            if ": export " in line and "TIMESLICE_TLS_CERT=" in line
        }
        assert set(exports) == {"job job-a", "job job-b", "operator (groups, status, top, members)"}
        assert exports["job job-a"] == {
            "TIMESLICE_JOB_ID": "job-a",
            CERT_ENV: str(session_pki.job("job-a").cert),
            KEY_ENV: str(session_pki.job("job-a").key),
        }
        assert not any(line.startswith(f"export {CERT_ENV}=") for line in info)
        operator_env = {**os.environ, **exports["operator (groups, status, top, members)"]}

        # The cluster serves: the CLI itself can list groups through it, as the operator.
        groups = subprocess.run(
            [sys.executable, "-m", "timeslice.cli", "groups", "--target", ",".join(targets)],
            capture_output=True, text=True, timeout=30, check=False, env=operator_env,
        )  # fmt: skip
        assert groups.returncode == 0, groups.stderr
        if stop_signal == signal.SIGINT:  # (once: each command is a second of start-up)
            # A job's certificate acts as its job, and as no other.
            job_env = {**os.environ, **exports["job job-a"]}
            for job, code in (("job-a", 0), ("job-b", 7)):
                held = subprocess.run(
                    [sys.executable, "-m", "timeslice.cli", "acquire", "g", "--job", job,
                     "--allow-unknown", "--hold", "0", "--timeout", "20",
                     "--target", ",".join(targets)],
                    capture_output=True, text=True, timeout=60, check=False, env=job_env,
                )  # fmt: skip
                assert held.returncode == code, (job, held.stderr)
            assert "permission_denied" in held.stderr, held.stderr

        proc.send_signal(stop_signal)
        assert proc.wait(timeout=30) == 0
        rest = []
        while (line := lines.get(timeout=10)) is not None:
            rest.append(line)
        assert rest[-1:] == ["stopped"]
        assert {name: pid for name, pid in pids.items() if alive(pid)} == {}
        assert processes_mentioning(str(base_dir)) == []
        assert processes_mentioning(prefix) == []
        assert not socket_path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        assert proc.stderr is not None
        proc.stderr.close()
        if proc.stdout is not None:
            proc.stdout.close()
