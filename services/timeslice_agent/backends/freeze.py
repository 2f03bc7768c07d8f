"""The ``freeze`` backend: SIGSTOP / SIGCONT of a job's registered worker processes.

It moves no bytes; it makes a job's processes stop issuing work so another job can use the
accelerators (the device memory stays allocated). Safety rules, all checked before any signal
is sent (a violation refuses the directive and signals nothing):

- never a pid registered with ``acquirer=True`` (the process that calls acquire must keep
  running, or the job could never yield again);
- never the agent itself, never pid 0 or 1;
- never a pid that does not exist (or is a zombie);
- never a process other than the one registered: each pid is re-checked against the identity
  pinned at registration (start time, uid, job label; :func:`~.base.check_targets`) after a
  pidfd to it is opened, and signals go through that pidfd, so a pid that is reused after the
  check cannot receive them.

A checkpoint waits until every process really is stopped (``T`` in /proc/<pid>/stat); if any
step fails, the processes it already stopped are resumed, so a failure leaves nothing frozen.

**The right to signal, checked at start** (:meth:`FreezeBackend.preflight`). The workers are not
known when the agent starts (they register later), so the check is the kernel's rule for
``kill(2)`` applied to every process that could register: a sender with ``CAP_KILL`` may signal
anyone; any other may signal only processes whose real or saved uid is its own real or
effective uid. Who can register is who can connect to the worker socket (mode 0660): the
agent's own uid and the users of the socket's group (its members, and those whose primary
group it is). So an agent with ``CAP_KILL`` (root) starts; one without it starts only if no
other user is in that group, and otherwise refuses naming them. Root-owned workers (root can
connect to any socket) are not counted: a non-root agent serving root's workers is refused at
their first switch, as before.
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import pwd
import signal
import time
from pathlib import Path

from timeslice_agent.backends.base import (
    Backend,
    BackendError,
    BackendRefused,
    BackendUnavailable,
    JobContext,
    SavedJob,
    Transfer,
    check_targets,
)
from timeslice_agent.config import AgentConfig
from timeslice_agent.procs import HAVE_PROC, identity_of, pid_exists, process_state
from timeslice_proto.timeslice.v1 import Device

log = logging.getLogger(__name__)

STOP_WAIT_SECONDS = 10.0
_POLL_SECONDS = 0.002
_HAVE_PIDFD = hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
CAP_KILL = 5  # linux/capability.h
_NAMED_AT_MOST = 5


def has_cap_kill(status: Path = Path("/proc/self/status")) -> bool:
    """Whether this process may signal any process: ``CAP_KILL`` in its effective set (where
    there is no /proc, being root)."""
    try:
        text = status.read_text()
    except OSError:
        return os.geteuid() == 0
    for line in text.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_KILL & 1)
    return os.geteuid() == 0


def group_users(gid: int) -> dict[int, str]:
    """The users of group ``gid`` by uid: its members and those whose primary group it is
    (as the user database lists them; blocking)."""
    users: dict[int, str] = {}
    try:
        members = grp.getgrgid(gid).gr_mem
    except KeyError:
        members = []
    for name in members:
        try:
            users[pwd.getpwnam(name).pw_uid] = name
        except KeyError:
            continue
    for entry in pwd.getpwall():
        if entry.pw_gid == gid:
            users[entry.pw_uid] = entry.pw_name
    return users


def signal_refusal(socket_group: int | None) -> str | None:
    """Why this process could not signal every worker that may register over a worker socket
    of group ``socket_group`` (None: its own group), or None when it can (blocking)."""
    if has_cap_kill():
        return None
    own = {os.getuid(), os.geteuid()}
    gid = os.getgid() if socket_group is None else socket_group
    others = sorted((u, n) for u, n in group_users(gid).items() if u not in own and u != 0)
    if not others:
        return None
    try:
        group = f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        group = f"gid {gid}"
    named = ", ".join(f"{n} (uid {u})" for u, n in others[:_NAMED_AT_MOST])
    if len(others) > _NAMED_AT_MOST:
        named += f" and {len(others) - _NAMED_AT_MOST} more"
    uid = os.geteuid()
    return (
        f"no permission to signal the workers: the agent runs as uid {uid} without CAP_KILL, "
        f"so it may stop only processes of uid {uid}, but the worker socket's group {group} "
        f"lets {named} register workers too. Run the agent as root, grant it CAP_KILL "
        "(setcap cap_kill+ep, or capabilities add KILL in its container), or pass "
        "--worker-socket-group naming a group no other user is in"
    )


class _Handles:
    """pidfds of the processes about to be signalled, opened before their identity is checked.

    A pidfd names one process, not a pid: if the checked process exits and its pid is reused,
    a signal through the pidfd fails (ProcessLookupError) instead of reaching the newcomer.
    Without pidfds (not Linux) signals go by pid.
    """

    def __init__(self) -> None:
        self._fds: dict[int, int] = {}
        self.gone: list[int] = []

    def open(self, pids: tuple[int, ...]) -> None:
        if not _HAVE_PIDFD:
            return
        for pid in pids:
            try:
                self._fds[pid] = os.pidfd_open(pid)
            except ProcessLookupError:
                self.gone.append(pid)

    def signal(self, pid: int, sig: signal.Signals) -> None:
        fd = self._fds.get(pid)
        if fd is None:
            if _HAVE_PIDFD:
                raise ProcessLookupError(pid)
            os.kill(pid, sig)
        else:
            signal.pidfd_send_signal(fd, sig)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class FreezeBackend(Backend):
    """SIGSTOP/SIGCONT of registered worker pids (see the module docstring for the rules)."""

    name = "freeze"
    emulated = False

    def __init__(
        self,
        *,
        own_pid: int | None = None,
        stop_wait: float = STOP_WAIT_SECONDS,
        socket_group: int | None = None,
    ) -> None:
        self._own_pid = os.getpid() if own_pid is None else own_pid
        self._stop_wait = stop_wait
        # The worker socket's group (None: the agent's own): whose processes may register.
        self._socket_group = socket_group

    async def preflight(self) -> None:
        """Refuse to start unless the agent may signal every worker that can register (see
        the module docstring)."""
        refusal = await asyncio.to_thread(signal_refusal, self._socket_group)
        if refusal is not None:
            raise BackendUnavailable(refusal)

    def _never_signal(self, pid: int) -> str | None:
        if pid <= 1:
            return f"refusing to signal pid {pid}"
        if pid == self._own_pid:
            return f"refusing to signal pid {pid}: it is the agent itself"
        return None

    def _check_freezable(self, job: JobContext) -> tuple[int, ...]:
        acquirers = {w.pid for w in job.workers if w.acquirer}
        pids = tuple(sorted({w.pid for w in job.workers}))
        for pid in pids:
            reason = self._never_signal(pid)
            if reason is None and pid in acquirers:
                reason = f"refusing to freeze pid {pid}: it is registered as the acquirer"
            if reason is None and not pid_exists(pid):
                reason = f"refusing to freeze pid {pid}: no such process"
            if reason is not None:
                raise BackendRefused(f"job {job.job_id}: {reason}")
        return pids

    def admit_checkpoint(self, job: JobContext) -> None:
        self._check_freezable(job)

    def admit_restore(self, job: JobContext) -> None:
        for pid in job.pids:
            reason = self._never_signal(pid)
            if reason is not None:
                raise BackendRefused(f"job {job.job_id}: {reason}")

    async def _wait_stopped(self, pid: int, deadline: float) -> None:
        while True:
            state = process_state(pid)
            if state is None:
                if not HAVE_PROC:
                    return
                raise BackendError(f"process {pid} vanished while being frozen")
            if state in ("T", "t"):
                return
            if state in ("Z", "X", "x"):
                raise BackendError(f"process {pid} exited while being frozen")
            if time.monotonic() >= deadline:
                raise BackendError(
                    f"process {pid} did not stop within {self._stop_wait:g} s (state {state})"
                )
            await asyncio.sleep(_POLL_SECONDS)

    @staticmethod
    def _resume(handles: _Handles, pids: list[int]) -> None:
        for pid in pids:
            try:
                handles.signal(pid, signal.SIGCONT)
            except OSError as exc:
                log.warning("could not resume pid %d after a failed freeze: %s", pid, exc)

    def checkpoint_bytes(self, job: JobContext) -> int:
        return 0  # frozen processes keep their memory where it is

    async def checkpoint(self, job: JobContext) -> Transfer:
        pids = self._check_freezable(job)
        started = time.monotonic()
        handles = _Handles()
        try:
            handles.open(pids)
            if handles.gone:
                raise BackendRefused(f"job {job.job_id}: refusing to freeze {handles.gone}: gone")
            await check_targets(job, pids, own_pid=self._own_pid)
            stopped: list[int] = []
            try:
                for pid in pids:
                    try:
                        handles.signal(pid, signal.SIGSTOP)
                    except ProcessLookupError:
                        raise BackendError(
                            f"process {pid} vanished between check and signal"
                        ) from None
                    except PermissionError:
                        raise BackendError(f"no permission to signal process {pid}") from None
                    stopped.append(pid)
                deadline = time.monotonic() + self._stop_wait
                for pid in pids:
                    await self._wait_stopped(pid, deadline)
            except BaseException:
                # Covers cancellation by the directive deadline too: never leave a job half
                # frozen.
                self._resume(handles, stopped)
                raise
        finally:
            handles.close()
        elapsed = time.monotonic() - started
        log.info("froze job %s: pids %s in %.3f s", job.job_id, list(pids), elapsed)
        return Transfer(bytes_moved=0, elapsed_seconds=elapsed)

    @staticmethod
    def _stop_again(handles: _Handles, resumed: list[int]) -> None:
        """Undo a restore that failed halfway: the ranks it resumed are stopped again."""
        for pid in resumed:
            try:
                handles.signal(pid, signal.SIGSTOP)
            except OSError:
                log.exception("could not stop pid %d again after a failed restore", pid)

    async def restore(self, job: JobContext) -> Transfer:
        self.admit_restore(job)
        acquirers = {w.pid for w in job.workers if w.acquirer}
        # The acquirer was never frozen; leave it alone.
        pids = [p for p in job.pids if p not in acquirers]
        started = time.monotonic()
        handles = _Handles()
        try:
            handles.open(tuple(pids))
            # A frozen process that exited (its pid possibly reused since) is not resumed; it
            # is reported below. Every other pid must still be the job's pinned process.
            replaced = await asyncio.to_thread(self._replaced, job, pids)
            vanished = sorted(set(handles.gone) | set(replaced))
            if vanished:
                # All or nothing: the job stays parked, every rank stopped, as the agent and
                # the orchestrator record it. Resuming the others would run them on devices
                # another job is being given (an NCCL rank spinning for its dead peer).
                raise BackendError(
                    f"processes {vanished} of job {job.job_id} vanished while frozen; "
                    "the others stay frozen"
                )
            await check_targets(job, pids, own_pid=self._own_pid)
            resumed: list[int] = []
            for pid in pids:
                try:
                    handles.signal(pid, signal.SIGCONT)
                except (ProcessLookupError, PermissionError) as exc:
                    self._stop_again(handles, resumed)
                    if isinstance(exc, PermissionError):
                        raise BackendError(f"no permission to signal process {pid}") from None
                    raise BackendError(
                        f"process {pid} of job {job.job_id} vanished while frozen; "
                        "the others stay frozen"
                    ) from None
                resumed.append(pid)
        finally:
            handles.close()
        elapsed = time.monotonic() - started
        log.info("resumed job %s: pids %s in %.3f s", job.job_id, pids, elapsed)
        return Transfer(bytes_moved=0, elapsed_seconds=elapsed)

    @staticmethod
    def _replaced(job: JobContext, pids: list[int]) -> list[int]:
        """The pids whose pinned process is gone (no process, or another one at that pid)."""
        replaced = []
        for pid in pids:
            pinned, now = job.identity(pid), identity_of(pid)
            if now is None or (pinned is not None and now.start_time != pinned.start_time):
                replaced.append(pid)
        return replaced

    async def reconcile(self, job: SavedJob) -> str | None:
        def gone_pids() -> list[int]:
            pinned = {i.pid: i for i in job.identities}
            gone = []
            for pid in job.saved_pids:
                now = identity_of(pid)
                if now is None or not pid_exists(pid):
                    gone.append(pid)
                elif pid in pinned and pinned[pid].start_time != now.start_time:
                    gone.append(pid)
            return gone

        gone = await asyncio.to_thread(gone_pids)
        if gone:
            return f"frozen processes {gone} vanished while the agent was down"
        return None

    def devices(self, discovered: list[Device]) -> list[Device]:
        return discovered


def create(config: AgentConfig) -> FreezeBackend:
    """The backend for ``--backend freeze`` (see :mod:`timeslice_agent.backends`)."""
    return FreezeBackend(socket_group=config.worker_socket_group)
