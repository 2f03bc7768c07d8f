"""Process inspection helpers (Linux procfs, with a signal-0 fallback elsewhere)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# Without procfs (non-Linux) process states cannot be read; the signal-0 probe is all we have.
HAVE_PROC = os.path.isdir("/proc/self")
PROC = Path("/proc")
# A parent chain is never longer than the number of processes; this bounds a corrupt read.
_MAX_ANCESTRY = 1 << 16


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (R, S, T, Z, ...), or None if it is gone."""
    try:
        # procfs is memory-backed: this read does not block the event loop in any real sense.
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may contain spaces; the state follows it.
    _, _, rest = text.rpartition(")")
    fields = rest.split()
    return fields[0] if fields else None


def pid_exists(pid: int) -> bool:
    """True if ``pid`` names a live (non-zombie) process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    state = process_state(pid)
    if state is None:
        return not HAVE_PROC
    return state not in ("Z", "X", "x")


@dataclass(frozen=True)
class ProcessIdentity:
    """One process, as opposed to one pid: what must still hold before the agent acts on it."""

    pid: int
    start_time: int
    uid: int
    euid: int


def _stat(pid: int, proc: Path) -> tuple[int, int] | None:
    """(ppid, start time) of ``pid`` from one read of /proc/<pid>/stat, or None if gone."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    # The command name is in parentheses and may hold spaces or ')': split after the last one.
    fields = text[text.rfind(")") + 2 :].split()
    try:
        # fields[0] is field 3 (state): ppid is field 4, starttime field 22.
        return int(fields[1]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _uids(pid: int, proc: Path) -> tuple[int, int] | None:
    try:
        with open(proc / str(pid) / "status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    real, effective = line.split()[1:3]
                    return int(real), int(effective)
    except (OSError, ValueError):
        return None
    return None


def identity_of(pid: int, proc: Path = PROC) -> ProcessIdentity | None:
    """The identity of the process now at ``pid``, or None if there is none (blocking read)."""
    if pid <= 0:
        return None
    stat = _stat(pid, proc)
    uids = _uids(pid, proc)
    if stat is None or uids is None:
        return None
    # Read stat again: if the start time moved, the uids may be another process's.
    again = _stat(pid, proc)
    if again is None or again[1] != stat[1]:
        return None
    return ProcessIdentity(pid=pid, start_time=stat[1], uid=uids[0], euid=uids[1])


def descends_from(pid: int, ancestor: int, proc: Path = PROC) -> bool:
    """True if ``pid`` is ``ancestor`` or one of its descendants (blocking read)."""
    current = pid
    for _ in range(_MAX_ANCESTRY):
        if current == ancestor:
            return True
        if current <= 1:
            return False
        stat = _stat(current, proc)
        if stat is None:
            return False
        current = stat[0]
    return False
