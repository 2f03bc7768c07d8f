"""Children of the dev tools die with their parent, and are started without a fork hook."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from timeslice_tools.dev._procs import spawn

PARENT = """
import sys
from pathlib import Path
from timeslice_tools.dev._procs import spawn
child = spawn(["sleep", "60"], Path(sys.argv[1]))
print(child.pid, flush=True)
sys.stdin.read()  # until killed
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""  # a zombie's is empty
    except FileNotFoundError:
        return False


def test_a_child_is_terminated_when_its_parent_is_killed(tmp_path: Path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "child.log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        # Its cmdline can read empty for an instant while setpriv execs the command.
        deadline = time.monotonic() + 10
        while not alive(child):
            assert time.monotonic() < deadline, "the child never ran"
            time.sleep(0.05)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_spawn_runs_the_command_itself(tmp_path: Path) -> None:
    log = tmp_path / "echo.log"
    proc = spawn(["sh", "-c", "echo $$; exec sleep 0.2"], log)
    assert proc.wait(timeout=10) == 0
    # The pid Popen reports is the command's own (the death-signal prefix execs it).
    assert str(proc.pid) in log.read_text().splitlines()[-1]
