"""Process inspection helpers (Linux procfs, with a signal-0 fallback elsewhere)."""

from __future__ import annotations

import os
import time
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


# ----- pid namespaces -------------------------------------------------------------------------


class ProcWalkTimeout(Exception):
    """A walk of /proc ran past its deadline (a process stuck in the kernel can hold a read)."""


def pid_namespace(pid: int | str, proc: Path = PROC) -> int | None:
    """The inode of the pid namespace ``pid`` (or ``"self"``) lives in, or None (blocking read).

    None: the process is gone, or the kernel has no ``/proc/<pid>/ns/pid`` (before 3.8).
    """
    try:
        link = os.readlink(proc / str(pid) / "ns" / "pid")
    except OSError:
        return None
    # "pid:[4026531836]"
    _, _, rest = link.partition("[")
    try:
        return int(rest.rstrip("]"))
    except ValueError:
        return None


def nspid_of(pid: int | str, proc: Path = PROC) -> tuple[int, ...] | None:
    """The ``NSpid:`` line of ``pid``'s status: its pid in each namespace, outermost first.

    The first entry is the pid in the namespace of the /proc mount read, the last one the pid
    in the process's own namespace. ``()`` when the kernel writes no NSpid line (before 4.1);
    None if the process is gone (blocking read).
    """
    try:
        with open(proc / str(pid) / "status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return tuple(int(x) for x in line.split()[1:])
    except (OSError, ValueError):
        return None
    return ()


def descendants_of(pid: int, proc: Path = PROC, *, deadline: float | None = None) -> list[int]:
    """``pid``'s descendants (not ``pid`` itself), from one walk of /proc (blocking reads).

    The walk is not atomic: a process may start or exit during it, so callers check what they
    find again. Raises :class:`ProcWalkTimeout` once ``time.monotonic()`` passes ``deadline``.
    """
    children: dict[int, list[int]] = {}
    try:
        entries = [e.name for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return []
    for n, name in enumerate(entries):
        if deadline is not None and n % 64 == 0 and time.monotonic() > deadline:
            raise ProcWalkTimeout(f"walking {proc} took too long")
        stat = _stat(int(name), proc)
        if stat is not None:
            children.setdefault(stat[0], []).append(int(name))
    found: list[int] = []
    todo = list(children.get(pid, ()))
    seen = {pid}
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        found.append(current)
        todo.extend(children.get(current, ()))
    return sorted(found)
