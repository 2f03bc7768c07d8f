"""Process and port helpers shared by the local etcd launcher and the local cluster.

Private to :mod:`timeslice_tools.dev`. Everything here is synchronous on purpose: these helpers
run in test fixtures, the CLI and the demo driver, never on a service's event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import os
import queue
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import IO

_LOG_TAIL_BYTES = 16_384


# Ports handed out come from a range the kernel never picks for an ephemeral bind (below
# ip_local_port_range), cut into slices: each pytest-xdist worker of a run gets its own slice,
# so two workers can no longer pick the same free port and race to bind it (a readiness probe
# then talks to the other worker's server). A slice is claimed with an advisory lock on a file
# (held until the process exits), so processes of different runs on one host (a second test
# run, a benchmark or a dev cluster beside CI) take different slices too.
_PORT_FLOOR = 10_000
_SLICE = 250
_SLICE_LOCKS = Path(tempfile.gettempdir()) / "timeslice-port-slices"
_cursor: dict[int, int] = {}
_claimed: dict[int, tuple[int, IO[bytes] | None]] = {}  # preferred slice -> claimed start, lock
_cursor_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _preferred_slice(slices: int) -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        # Workers of one run take consecutive slices from an offset of the run's own.
        offset = int.from_bytes(run.encode()[-4:] or b"\0", "big") % slices
        return (offset + int(worker[2:])) % slices
    return os.getpid() % slices


def _slice_start() -> int:
    """The first port of this process's slice: the first one free of a lock from its
    preferred one on (when locks cannot be taken at all, the preferred one)."""
    slices = max(1, (_ephemeral_low() - _PORT_FLOOR) // _SLICE)
    preferred = _preferred_slice(slices)
    with _cursor_lock:
        claim = _claimed.get(preferred)
        if claim is None:
            claim = _claimed[preferred] = _claim(preferred, slices)
        return claim[0]


def _claim(preferred: int, slices: int) -> tuple[int, IO[bytes] | None]:
    try:
        _SLICE_LOCKS.mkdir(mode=0o777, exist_ok=True)
    except OSError:
        return _PORT_FLOOR + preferred * _SLICE, None
    for step in range(slices):
        index = (preferred + step) % slices
        try:
            lock = (_SLICE_LOCKS / f"{index}.lock").open("ab")
        except OSError:
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()  # another process (or another worker slot of this one) has it
            continue
        return _PORT_FLOOR + index * _SLICE, lock
    return _PORT_FLOOR + preferred * _SLICE, None


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``count`` distinct TCP ports that were free on ``host`` a moment ago.

    Taken in turn from this process's slice (see ``_SLICE``), so one process never returns a
    port twice while the slice lasts, and parallel test workers never return the same port.
    """
    start = _slice_start()
    ports: list[int] = []
    with _cursor_lock:
        cursor = _cursor.get(start, 0)
        for _ in range(_SLICE):
            port = start + cursor
            cursor = (cursor + 1) % _SLICE
            if port not in ports and _bindable(port, host):
                ports.append(port)
                if len(ports) == count:
                    break
        _cursor[start] = cursor
    if len(ports) < count:
        raise OSError(f"no {count} free ports left in {start}-{start + _SLICE - 1} on {host}")
    return ports


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped.

    The signal is delivered asynchronously: a thread running on another core answers one more
    request after ``kill`` returned (a paused etcd committed a write that way), so a fault test
    that pauses a service must wait for the stop before it counts on the silence."""
    os.kill(pid, signal.SIGSTOP)
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():
        return  # no procfs: nothing to wait on
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for stat in tasks.glob("*/stat"):
            with contextlib.suppress(OSError):  # a thread that just exited
                states.append(stat.read_text().rpartition(")")[2].split()[0])
        if all(state in ("T", "t", "Z", "X") for state in states):
            return
        time.sleep(0.001)


def log_tail(path: Path, max_lines: int = 40) -> str:
    """The last lines of a log file, or a note saying why there is nothing to show."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _LOG_TAIL_BYTES))
            data = f.read()
    except OSError as exc:
        return f"(no log at {path}: {exc.strerror})"
    lines = data.decode("utf-8", errors="replace").splitlines()[-max_lines:]
    if not lines:
        return f"(log {path} is empty)"
    return "\n".join(lines)


def log_size(path: Path) -> int:
    """The current size of a log file (0 when it does not exist yet)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def log_since(path: Path, offset: int) -> str:
    """What a log file gained after ``offset`` (what one start attempt wrote)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def http_status(
    url: str, timeout: float = 0.5, context: ssl.SSLContext | None = None
) -> tuple[int, bytes] | None:
    """GET ``url``; the status and body, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:
            return int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read()
    except (OSError, ValueError, http.client.HTTPException):
        # Connection refused/reset, timeouts and half-started servers all mean "not yet"; so
        # does a server that does not speak HTTP/1 (a port someone else took meanwhile).
        return None


def _pdeathsig_prefix() -> list[str]:
    """A command prefix asking Linux to SIGTERM the child when its parent dies.

    This keeps a test run or a benchmark that is killed (-9, or a SIGTERM that runs no
    ``finally``) from leaking etcd or service processes. The signal fires when the *thread*
    that started the child exits, so only two threads start children: the main thread, and
    one spawner thread that lives as long as the process (see :func:`spawn`).

    A prefix (util-linux ``setpriv --pdeathsig``), not a ``preexec_fn``: a preexec hook makes
    ``subprocess`` fork instead of vfork, and a fork runs grpcio's fork handlers in the child,
    whose restarted poller thread aborts once ``close_fds`` closed its epoll descriptor
    (grpc/grpc#43055, grpcio 1.80 and later): the child died with SIGABRT before its exec, about
    one start in ten while this process had gRPC channels open.

    The death signal only covers a parent that dies after ``setpriv`` set it: one killed
    between the fork and that moment (a loaded machine, a run killed as it starts) would leave
    the child running for ever. So a shell checks, once the signal is set, that its parent is
    still the process that started it, and only then execs the command (same pid throughout).
    """
    if sys.platform != "linux" or not _lives_with_the_process(threading.current_thread()):
        return []
    setpriv, sh = shutil.which("setpriv"), shutil.which("sh")
    if not (setpriv and sh):
        return []
    still_ours = 'test "$PPID" = "$0" || exit 1; exec "$@"'
    return [setpriv, "--pdeathsig", "TERM", "--", sh, "-c", still_ours, str(os.getpid())]


def spawn(
    argv: list[str],
    log_path: Path,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session with stdout and stderr appended to ``log_path``.

    Its own session so that a Ctrl-C in the terminal reaches only our supervisor, which then
    stops the children in order instead of all of them dying at once.

    Called from a thread other than the main one (``asyncio.to_thread``, an executor), the
    child is started on the spawner thread, which lives until the process exits: started on
    the caller's thread, its death signal would fire when that thread ends (killing a cluster
    that should outlive it), so it could not be set, and a killed benchmark left its cluster
    running.
    """
    if threading.current_thread() is threading.main_thread():
        return _start(argv, log_path, env, cwd)
    return _SPAWNER.run(lambda: _start(argv, log_path, env, cwd))


def _start(
    argv: list[str], log_path: Path, env: dict[str, str] | None, cwd: Path | None
) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(argv)}\n".encode())
        log.flush()
        return subprocess.Popen(
            [*_pdeathsig_prefix(), *argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )


class _Spawner:
    """One daemon thread that starts children for the other threads, for the process's life.

    A daemon thread ends only with the process, so the death signal of a child it started
    fires exactly when the process dies. Started on first use.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._requests: queue.SimpleQueue[
            tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]
        ] = queue.SimpleQueue()

    def owns(self, thread: threading.Thread) -> bool:
        return thread is self._thread

    def run(self, start: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        """Call ``start`` on the spawner thread and return what it returned (or raise)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="timeslice-spawner", daemon=True
                )
                self._thread.start()
        done: Future[subprocess.Popen[bytes]] = Future()
        self._requests.put((start, done))
        # A start is a fork and an exec (milliseconds); the bound only guards against a wedge.
        try:
            return done.result(timeout=60)
        except TimeoutError:
            if not done.cancel():
                # Started meanwhile, for nobody: stop it rather than leave it running.
                done.add_done_callback(_kill_unclaimed)
            raise

    def _serve(self) -> None:
        while True:
            start, done = self._requests.get()
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(start())
            except BaseException as exc:  # handed to the caller, which raises it
                done.set_exception(exc)


def _kill_unclaimed(done: Future[subprocess.Popen[bytes]]) -> None:
    if not done.cancelled() and done.exception() is None:
        kill(done.result())


_SPAWNER = _Spawner()


def _lives_with_the_process(thread: threading.Thread) -> bool:
    return thread is threading.main_thread() or _SPAWNER.owns(thread)


def terminate_all(processes: Iterable[subprocess.Popen[bytes]], grace: float = 5.0) -> None:
    """SIGTERM every live process, wait up to ``grace`` seconds in total, SIGKILL the rest."""
    live = [p for p in processes if p.poll() is None]
    for proc in live:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in live:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            kill(proc)


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` (if it still runs) and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    # After SIGKILL the kernel reaps promptly; the bound only guards against a D-state process.
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10.0)


def address_in_use(log_text: str) -> bool:
    """Whether a failed start's log says a port was taken (worth retrying on other ports)."""
    lowered = log_text.lower()
    return "address already in use" in lowered or "eaddrinuse" in lowered
