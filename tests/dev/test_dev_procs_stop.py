"""``_procs.stop_process``: when it returns, every thread of the process has stopped (a paused
etcd once committed one more write after its SIGSTOP, because the signal lands a moment after
``kill`` returns)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from timeslice_tools.dev._procs import stop_process

# Four threads spinning on the CPU: the ones most likely still running when kill returns.
BUSY = """
import threading
def spin():
    while True:
        pass
for _ in range(3):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
spin()
"""


def _thread_states(pid: int) -> list[str]:
    return [
        stat.read_text().rpartition(")")[2].split()[0]
        for stat in Path(f"/proc/{pid}/task").glob("*/stat")
    ]


def test_every_thread_is_stopped_when_it_returns() -> None:
    proc = subprocess.Popen([sys.executable, "-c", BUSY], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for _ in range(20):
            stop_process(proc.pid)
            states = _thread_states(proc.pid)
            assert len(states) == 4 and set(states) == {"T"}, states
            os.kill(proc.pid, signal.SIGCONT)
    finally:
        proc.kill()
        proc.wait(10)
