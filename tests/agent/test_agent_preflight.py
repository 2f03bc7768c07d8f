"""An agent whose backend cannot act refuses to start, in one line naming the backend, what is
missing and how to fix it (the backend's ``preflight``); one that can act starts.

Real agent processes. Those that must lack a right run as root without a capability (dropped
from the bounding set in the child before exec, as a container's ``capabilities: drop`` does),
so the tests need root.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PR_CAPBSET_DROP = 24  # linux/prctl.h
CAP_DAC_OVERRIDE, CAP_KILL = 1, 5
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="drops capabilities of root")


def without(*caps: int) -> Callable[[], None]:
    """A preexec_fn: the child (root) execs without ``caps`` (gone from its bounding set)."""

    def drop() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in caps:
            if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), f"cannot drop capability {cap}")

    return drop


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory nobody may write (pytest's own tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="ts-preflight-"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", str(path)], check=False)


def agent_argv(directory: Path, backend: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "timeslice_agent",
        "--orchestrator", "127.0.0.1:1", "--node", "n1", "--backend", backend,
        "--worker-socket", str(directory / "w.sock"),
        "--state-file", str(directory / "state.json"), "--insecure", *extra,
    ]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMESLICE_")}
    env["PATH"] = "/usr/bin:/bin"  # no cuda-checkpoint to fall back to
    return env


def refused(argv: list[str], preexec: Callable[[], None] | None = None) -> str:
    """Run an agent that must refuse to start: its one stderr line (exit status 2)."""
    proc = subprocess.Popen(
        argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=preexec,
    )  # fmt: skip
    try:
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"the agent started instead of refusing: {err[-2000:]}")
    assert proc.returncode == 2, (proc.returncode, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def starts(argv: list[str], socket: Path, preexec: Callable[[], None] | None = None) -> None:
    """Run an agent that must start: its worker socket appears; SIGTERM ends it with 0."""
    proc = subprocess.Popen(
        argv, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=preexec,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not socket.exists():
            if proc.poll() is not None:
                pytest.fail(f"the agent exited {proc.returncode}: {proc.communicate()[1]}")
            assert time.monotonic() < deadline, "the agent did not start within 30 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@needs_root
def test_freeze_agent_that_may_not_signal_the_workers_refuses_to_start(
    shared_dir: Path,
) -> None:
    # Without CAP_KILL the agent (uid 0) may signal only uid 0's processes, but a socket of
    # group nogroup lets nobody's, sync's and _apt's workers register.
    argv = agent_argv(shared_dir, "freeze", "--worker-socket-group", "nogroup")
    line = refused(argv, without(CAP_KILL))
    assert line.startswith("timeslice-agent: cannot start the freeze backend: "), line
    assert "no permission to signal the workers" in line and "without CAP_KILL" in line, line
    assert "nobody (uid 65534)" in line and "group nogroup (gid 65534)" in line, line
    assert "grant it CAP_KILL" in line and "--worker-socket-group" in line, line
    assert not (shared_dir / "w.sock").exists()
    assert not (shared_dir / "state.json").exists()


@needs_root
def test_agents_that_can_act_start(shared_dir: Path) -> None:
    # Root with CAP_KILL may signal anyone.
    starts(agent_argv(shared_dir / "a", "freeze"), shared_dir / "a" / "w.sock")
    # Without it, but with a socket only root's processes can reach (group root has no other
    # user), it may signal every worker that can register: same uid.
    starts(agent_argv(shared_dir / "b", "freeze"), shared_dir / "b" / "w.sock", without(CAP_KILL))
    # The sim backend needs nothing.
    starts(agent_argv(shared_dir / "c", "sim"), shared_dir / "c" / "w.sock", without(CAP_KILL))


@needs_root
def test_app_agent_that_cannot_create_the_worker_socket_refuses_to_start(
    shared_dir: Path,
) -> None:
    closed = shared_dir / "closed"
    closed.mkdir(mode=0o755)
    os.chown(closed, 65534, 65534)  # another user's: root without CAP_DAC_OVERRIDE may not write
    argv = agent_argv(shared_dir, "app")
    argv[argv.index("--worker-socket") + 1] = str(closed / "run" / "w.sock")
    line = refused(argv, without(CAP_DAC_OVERRIDE))
    assert line.startswith("timeslice-agent: cannot start the app backend: "), line
    assert f"{closed} is not writable by the agent (uid 0)" in line, line
    assert "--worker-socket" in line, line
    assert not (closed / "run").exists()


def _libcuda_loads() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_libcuda_loads(), reason="this machine has an NVIDIA driver")
def test_cuda_agent_without_a_driver_refuses_to_start_saying_what_to_install(
    shared_dir: Path,
) -> None:
    line = refused(agent_argv(shared_dir, "cuda"))
    assert line.startswith("timeslice-agent: cannot start the cuda backend: "), line
    assert "libcuda.so.1 not found" in line and "install the NVIDIA driver" in line, line
    assert "cuda-checkpoint not found on PATH" in line and "--cuda-checkpoint-bin" in line, line
    assert not (shared_dir / "w.sock").exists()
