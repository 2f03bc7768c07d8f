"""Process inspection helpers (Linux procfs, with a signal-0 fallback elsewhere)."""

from __future__ import annotations

import os
from pathlib import Path

# Without procfs (non-Linux) process states cannot be read; the signal-0 probe is all we have.
HAVE_PROC = os.path.isdir("/proc/self")


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
