"""Children of the dev tools die with their parent, and are started without a fork hook."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from timeslice_tools.dev import _procs
from timeslice_tools.dev._procs import spawn

PARENT = """
import sys
from pathlib import Path
from timeslice_tools.dev._procs import spawn
child = spawn(["sleep", "60"], Path(sys.argv[1]))
print(child.pid, flush=True)
sys.stdin.read()  # until killed
"""

# As a benchmark starts its cluster (``asyncio.to_thread``): from a thread that then ends.
PARENT_THREAD = """
import sys, threading
from pathlib import Path
from timeslice_tools.dev._procs import spawn
started = []
starter = threading.Thread(target=lambda: started.append(spawn(["sleep", "60"], Path(sys.argv[1]))))
starter.start()
starter.join()
print(started[0].pid, flush=True)
sys.stdin.read()  # until killed
"""


def alive(pid: int) -> bool:
    """A live process (not a zombie): its state, since its cmdline reads empty mid-exec."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(") ", 1)[-1][:1] not in ("Z", "X", "")


def running(pid: int, command: str) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == command.encode()
    except FileNotFoundError:
        return False


def _parent(tmp_path: Path, script: str = PARENT) -> tuple[subprocess.Popen[str], int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "child.log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert parent.stdout is not None
    return parent, int(parent.stdout.readline())


def _outlives(parent: subprocess.Popen[str], child: int) -> bool:
    """Kill ``parent``; whether ``child`` is still alive 10 s later."""
    parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while alive(child):
        if time.monotonic() > deadline:
            os.kill(child, signal.SIGKILL)
            return True
        time.sleep(0.05)
    return False


def test_a_child_is_terminated_when_its_parent_is_killed(tmp_path: Path) -> None:
    parent, child = _parent(tmp_path)
    # Once the command runs, the death signal is set (setpriv set it before its exec).
    deadline = time.monotonic() + 10
    while not running(child, "sleep"):
        assert time.monotonic() < deadline, "the child never ran its command"
        time.sleep(0.01)
    assert not _outlives(parent, child), "the child outlived its parent"


def test_a_child_started_from_a_thread_that_ended_lives_until_its_parent_is_killed(
    tmp_path: Path,
) -> None:
    """A benchmark starts its cluster from a worker thread. The child must outlive that
    thread (the cluster serves on), and still die with the process."""
    parent, child = _parent(tmp_path, PARENT_THREAD)
    deadline = time.monotonic() + 10
    while not running(child, "sleep"):
        assert time.monotonic() < deadline, "the child never ran its command"
        time.sleep(0.01)
    time.sleep(0.5)  # the starting thread has ended: a signal tied to it would have fired
    assert running(child, "sleep"), "the child died with the thread that started it"
    assert not _outlives(parent, child), "the child outlived its parent"


def test_a_child_started_for_a_parent_that_is_gone_does_not_run() -> None:
    """The prefix's last step: once the death signal is set, the child runs its command only
    if its parent is still the process that started it. A parent that died between the fork
    and that moment (a loaded machine) has handed the child to another process, and the
    signal would never come. Here the prefix names a parent that is not the child's."""
    prefix = _procs._pdeathsig_prefix()
    assert prefix, "setpriv and sh are there on this machine"
    assert prefix[-1] == str(os.getpid())
    for parent, code in ((str(os.getpid()), 0), ("1", 1)):
        started = subprocess.run([*prefix[:-1], parent, "true"], timeout=30, check=False)
        assert started.returncode == code, (parent, started)


def test_spawn_runs_the_command_itself(tmp_path: Path) -> None:
    log = tmp_path / "echo.log"
    proc = spawn(["sh", "-c", "echo $$; exec sleep 0.2"], log)
    assert proc.wait(timeout=10) == 0
    # The pid Popen reports is the command's own (the death-signal prefix execs it).
    assert str(proc.pid) in log.read_text().splitlines()[-1]
