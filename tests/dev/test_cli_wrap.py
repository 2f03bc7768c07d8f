"""``timeslice run``: a group held for the life of a command, with real processes (the wrapper
and its command as subprocesses, a real orchestrator and etcd over TLS)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from timeslice import TimeSliceOrchestratorClient
from timeslice.cli.wrap import EXIT_NOT_FOUND, EXIT_NOT_STARTED
from timeslice_tools.dev.certs import Pki
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.dev.etcd import EtcdServer

TIMESLICE = [sys.executable, "-m", "timeslice_tools.cli"]
# Generous: a loaded 2-core machine starts a Python process with gRPC in seconds, not ms.
DEADLINE = 30.0

# CMD for most tests: records its pid and labels, starts a grandchild in its process group,
# then exits with argv[2] once the file argv[1]/go exists. With argv[3] == "trap" it exits 7 on
# SIGTERM; with "ignore" it ignores SIGTERM.
CHILD = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from pathlib import Path
    box, code, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if mode == "trap":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))
    elif mode == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    grandchild = subprocess.Popen(["sleep", "600"])
    (box / "labels").write_text(
        f"{os.environ['TIMESLICE_JOB_ID']} {os.environ['TIMESLICE_GROUP']}"
    )
    (box / "pids.tmp").write_text(f"{os.getpid()} {grandchild.pid}")
    os.rename(box / "pids.tmp", box / "pids")
    while not (box / "go").exists():
        time.sleep(0.05)
    sys.exit(code)
    """
)


@pytest.fixture(scope="module")
def cluster(
    session_pki: Pki, tls_etcd_server: EtcdServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    # No agents: a hold needs only the orchestrator. TLS, as the session's clients expect.
    with LocalCluster(
        replicas=1,
        agents=0,
        tls=session_pki,
        etcd_endpoint=tls_etcd_server.endpoint,
        base_dir=tmp_path_factory.mktemp("run-cluster"),
    ) as c:
        yield c


@pytest.fixture(scope="module")
def observer(cluster: LocalCluster) -> Iterator[TimeSliceOrchestratorClient]:
    """Reads group status (status opens no session, so it never appears in a group)."""
    with TimeSliceOrchestratorClient(cluster.target, job_id="run-observer") as client:
        yield client


def start(
    cluster: LocalCluster, group: str, job: str, *cmd: str, opts: tuple[str, ...] = ()
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            *TIMESLICE,
            "run",
            "--group",
            group,
            "--job",
            job,
            "--target",
            cluster.target,
            *opts,
            "--",
            *cmd,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def child(box: Path, code: int = 0, mode: str = "plain") -> tuple[str, ...]:
    return (sys.executable, "-c", CHILD, str(box), str(code), mode)


def finish(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=DEADLINE)
    return proc.returncode, out, err


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in {timeout} s: {what}"
        time.sleep(0.05)


def pids(box: Path) -> tuple[int, int]:
    """CMD's pid and its grandchild's, once CMD is running."""
    wait_for(lambda: (box / "pids").exists(), "CMD started")
    cmd, grandchild = (box / "pids").read_text().split()
    return int(cmd), int(grandchild)


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, which nobody may reap in a container, is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def holder(observer: TimeSliceOrchestratorClient, group: str) -> str:
    return observer.status(group).holder_job_id


def kill_quietly(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=DEADLINE)
    # Not communicate(): CMD's leftovers may hold the pipes open (the box fixture kills them).
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Path]:
    """A folder for CMD's files; any CMD process group still there at the end is killed (a
    SIGKILLed wrapper leaves CMD's children behind, and they hold the wrapper's pipes)."""
    yield tmp_path
    for found in tmp_path.rglob("pids"):
        try:
            os.killpg(int(found.read_text().split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


# -- input checked before anything is contacted ----------------------------------------------


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--group", "g", "--job", "j"), "no command to run"),
        (("--group", "g", "--job", "j", "--"), "no command to run"),
        (("--group", "bad group", "--job", "j", "--", "true"), "group_id 'bad group' is not valid"),
        (("--job", "j", "--", "true"), "--group is required (or $TIMESLICE_GROUP)"),
        (("--group", "g", "--job", "../x", "--", "true"), "job_id '../x' is not valid"),
        (("--group", "g", "--job", "j", "--timeout", "0", "--", "true"), "'0' must be positive"),
    ],
)
def test_bad_input_exits_2(args: tuple[str, ...], expected: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TIMESLICE_GROUP", "TIMESLICE_JOB_ID")}
    result = subprocess.run(
        [*TIMESLICE, "run", "--target", "127.0.0.1:1", *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        env=env,
    )
    assert result.returncode == 2, result
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: invalid_argument: ") and expected in last, result.stderr


def test_missing_command_is_127_before_any_wait() -> None:
    # An unreachable orchestrator: had the wrapper tried to acquire, it would exit 125.
    result = subprocess.run(
        [
            *TIMESLICE,
            "run",
            "--group",
            "g",
            "--job",
            "j",
            "--target",
            "127.0.0.1:1",
            "--",
            "no-such-command-anywhere",
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert result.returncode == EXIT_NOT_FOUND, result
    assert result.stderr.strip().splitlines()[-1] == (
        "error: not_found: cannot run no-such-command-anywhere: command not found"
    )


def test_unreachable_orchestrator_is_125_and_cmd_never_starts(box: Path) -> None:
    marker = box / "started"
    result = subprocess.run(
        [
            *TIMESLICE,
            "run",
            "--group",
            "g",
            "--job",
            "j",
            "--target",
            "127.0.0.1:1",
            "--timeout",
            "2",
            "--",
            "touch",
            str(marker),
        ],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
    )
    assert result.returncode == EXIT_NOT_STARTED, result
    assert not marker.exists()
    assert result.stderr.strip().splitlines()[-1].startswith("error: "), result.stderr


# -- against an orchestrator -----------------------------------------------------------------


@pytest.mark.parametrize("code", [0, 3])
def test_holds_for_the_life_of_cmd_and_passes_its_status(
    cluster: LocalCluster, observer: TimeSliceOrchestratorClient, box: Path, code: int
) -> None:
    group, job = f"run-life-{code}", f"run-job-{code}"
    proc = start(cluster, group, job, *child(box, code))
    try:
        _, grandchild = pids(box)
        assert (box / "labels").read_text() == f"{job} {group}"
        assert holder(observer, group) == job
        (box / "go").touch()
        status, out, err = finish(proc)
        assert status == code, err
        assert out == ""  # stdout is CMD's alone
        assert f"timeslice run: yielded {group}" in err
        assert holder(observer, group) == ""
        # What CMD left running in its process group went with it.
        wait_for(lambda: not alive(grandchild), "the grandchild killed")
    finally:
        kill_quietly(proc)


def test_cmd_killed_by_a_signal_is_128_plus_n_and_the_group_is_released(
    cluster: LocalCluster, observer: TimeSliceOrchestratorClient
) -> None:
    group = "run-killed"
    proc = start(cluster, group, "run-killed-job", "sh", "-c", "kill -KILL $$")
    try:
        status, _, err = finish(proc)
        assert status == 128 + signal.SIGKILL, err
        assert holder(observer, group) == ""
    finally:
        kill_quietly(proc)


def test_sigterm_is_forwarded_to_cmd_and_the_group_released(
    cluster: LocalCluster, observer: TimeSliceOrchestratorClient, box: Path
) -> None:
    group = "run-term"
    proc = start(cluster, group, "run-term-job", *child(box, mode="trap"))
    try:
        _, grandchild = pids(box)
        proc.send_signal(signal.SIGTERM)
        status, _, err = finish(proc)
        # CMD handled the forwarded SIGTERM (exit 7); its grandchild got it too (its group).
        assert status == 7, err
        assert not alive(grandchild)
        assert holder(observer, group) == ""
    finally:
        kill_quietly(proc)


def test_cmd_ignoring_sigterm_is_killed_after_the_deadline(
    cluster: LocalCluster, observer: TimeSliceOrchestratorClient, box: Path
) -> None:
    group = "run-stubborn"
    proc = start(
        cluster, group, "run-stubborn-job", *child(box, mode="ignore"), opts=("--kill-after", "1")
    )
    try:
        cmd, _ = pids(box)
        proc.send_signal(signal.SIGTERM)
        status, _, err = finish(proc)
        assert status == 128 + signal.SIGKILL, err
        assert "after a stop signal: killed" in err
        assert not alive(cmd)
        assert holder(observer, group) == ""
    finally:
        kill_quietly(proc)


def test_a_killed_wrapper_loses_the_hold_with_its_session_and_cmd_dies(
    cluster: LocalCluster, box: Path
) -> None:
    group, ttl = "run-sigkill", 2
    proc = start(cluster, group, "run-doomed", *child(box), opts=("--session-ttl", str(ttl)))
    try:
        cmd, _ = pids(box)
        with TimeSliceOrchestratorClient(cluster.target, job_id="run-next") as nxt:
            proc.kill()
            killed = time.monotonic()
            grant = nxt.acquire(group, timeout=DEADLINE)
            elapsed = time.monotonic() - killed
            assert grant.job_id == "run-next"
            # The lease TTL, then etcd's expiry sweep and the grant, with room for a slow box.
            assert elapsed <= ttl + 8, f"granted {elapsed:.2f} s after the wrapper died"
            # The kernel killed CMD with its parent (PR_SET_PDEATHSIG).
            wait_for(lambda: not alive(cmd), "CMD killed with the wrapper", timeout=5)
            nxt.yield_(group)
    finally:
        kill_quietly(proc)


def test_acquire_timeout_and_interrupt_while_waiting_never_start_cmd(
    cluster: LocalCluster, observer: TimeSliceOrchestratorClient, box: Path
) -> None:
    group = "run-busy"
    (box / "a").mkdir()
    first = start(cluster, group, "run-first", *child(box / "a"))
    try:
        pids(box / "a")
        marker = box / "started"
        late = start(cluster, group, "run-late", "touch", str(marker), opts=("--timeout", "1"))
        status, _, err = finish(late)
        assert status == EXIT_NOT_STARTED, err
        assert err.strip().splitlines()[-1].startswith("error: timeout: "), err
        assert not marker.exists()

        waiter = start(cluster, group, "run-waiter", "touch", str(marker))
        try:
            wait_for(lambda: bool(observer.status(group).queue), "the waiter queued")
            waiter.send_signal(signal.SIGTERM)
            status, _, err = finish(waiter)
            assert status == 128 + signal.SIGTERM, err
            assert "SIGTERM while waiting for run-busy; CMD not started" in err
        finally:
            kill_quietly(waiter)
        assert not marker.exists()
        wait_for(lambda: not observer.status(group).queue, "the waiter left the queue")
        assert holder(observer, group) == "run-first"
        (box / "a" / "go").touch()
        assert finish(first)[0] == 0
    finally:
        kill_quietly(first)
