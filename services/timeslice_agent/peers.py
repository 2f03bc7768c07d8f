"""Who is on the other end of the worker socket, and which processes the agent may act on.

The agent runs as root (on Kubernetes: privileged, with ``hostPID``), so a pid it is handed is
a pid it can stop or checkpoint. Two rules keep that power to what the registrant already has:

- **A registration names only the registrant or its descendants.** The kernel tells who
  connected (``SO_PEERCRED``: pid, effective uid and gid at ``connect()``); the registered
  pid must be that process or reach it through its ``/proc/<pid>/stat`` parent chain, and, for
  a peer that is not root, run as the peer's uid. Where the kernel offers ``SO_PEERPIDFD``
  (Linux 6.5+) the agent also checks that the process that connected still lives, so a socket
  handed to another process cannot borrow a recycled pid as its identity.
- **A pid is acted on only while it is the process that was pinned.** A registration (or a
  discovery) pins the process's :class:`ProcessIdentity`: its start time (``/proc/<pid>/stat``
  field 22, ticks since boot, unique per pid for the life of the machine) and its real and
  effective uid. Before any signal or checkpoint the backends read them again
  (:func:`target_refusal`); a pid that was reused by another process, changed uid, or whose
  environment names another job is refused. Never pid 0 or 1, never the agent itself.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpclib.server

from timeslice.errors import PermissionDenied
from timeslice_agent.discovery import labels_of
from timeslice_agent.procs import PROC, ProcessIdentity, descends_from, identity_of

# struct ucred { pid_t pid; uid_t uid; gid_t gid; }
_UCRED = struct.Struct("iII")
# Not in Python 3.11's socket module; the value is the same on every Linux architecture.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


@dataclass(frozen=True)
class PeerCredentials:
    """The process that connected to the worker socket, as the kernel recorded it."""

    pid: int
    uid: int
    gid: int


def credentials_of_socket(sock: socket.socket) -> PeerCredentials:
    """``SO_PEERCRED`` of a connected unix socket; raises PermissionDenied if unusable."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError as exc:
        raise PermissionDenied(f"cannot read the peer's credentials: {exc}") from None
    pid, uid, gid = _UCRED.unpack(raw)
    if pid <= 0:
        raise PermissionDenied("the kernel reported no peer process for this connection")
    _check_connector_alive(sock, pid)
    return PeerCredentials(pid=pid, uid=uid, gid=gid)


def _check_connector_alive(sock: socket.socket, pid: int) -> None:
    """Refuse a connection whose connecting process is gone (its pid may now be another's)."""
    try:
        fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError:
        return  # an older kernel: the ancestry and uid checks still apply
    try:
        # A pidfd's fdinfo names the process it refers to, or -1 once it has exited.
        with open(f"/proc/self/fdinfo/{fd}") as f:
            for line in f:
                if line.startswith("Pid:"):
                    if int(line.split()[1]) != pid:
                        raise PermissionDenied(
                            f"the process that connected (pid {pid}) has exited; its "
                            "connection cannot register workers"
                        )
                    return
    except OSError:
        return
    finally:
        os.close(fd)


def credentials_of_stream(stream: grpclib.server.Stream[Any, Any]) -> PeerCredentials:
    """The peer of a grpclib server stream on a unix socket; raises PermissionDenied.

    grpclib (pinned at 0.4.9) exposes the connection's transport only through ``Peer``'s
    private ``_transport``. If a later version moves it, every registration is refused (the
    tests of the worker socket then fail) rather than accepted unchecked.
    """
    transport = getattr(stream.peer, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        raise PermissionDenied("registrations are accepted only over the agent's unix socket")
    return credentials_of_socket(sock)


def authorize_registration(
    peer: PeerCredentials, pid: int, job_id: str, *, own_pid: int, proc: Path = PROC
) -> ProcessIdentity:
    """Pin the process ``pid`` for ``peer``, or raise PermissionDenied (blocking reads).

    See the module docstring for the rule.
    """
    if pid <= 1 or pid == own_pid:
        raise PermissionDenied(f"pid {pid} cannot be registered")
    target = identity_of(pid, proc)
    if target is None:
        raise PermissionDenied(f"pid {pid}: no such process")
    connector = identity_of(peer.pid, proc)
    if connector is None or connector.euid != peer.uid:
        raise PermissionDenied(
            f"the process that connected (pid {peer.pid}) is gone or changed its identity"
        )
    if peer.uid != 0 and (target.uid != peer.uid or target.euid != peer.uid):
        raise PermissionDenied(
            f"pid {pid} runs as uid {target.uid}/{target.euid}; a worker of uid {peer.uid} "
            "may only register its own processes"
        )
    if not descends_from(pid, peer.pid, proc):
        raise PermissionDenied(
            f"pid {pid} is neither the registering process (pid {peer.pid}) nor one of its "
            "descendants"
        )
    labels = labels_of(pid, proc)
    if labels is not None and labels.job_id != job_id:
        raise PermissionDenied(
            f"pid {pid} belongs to job {labels.job_id} by its environment (TIMESLICE_JOB_ID); "
            f"it cannot be registered for job {job_id}"
        )
    # The chain was read over several reads: if the pid changed hands meanwhile, refuse.
    if identity_of(pid, proc) != target:
        raise PermissionDenied(f"pid {pid} changed while it was being checked")
    return target


def target_refusal(
    pid: int,
    pinned: ProcessIdentity | None,
    job_id: str,
    *,
    own_pid: int,
    proc: Path = PROC,
) -> str | None:
    """Why the agent must not act on ``pid`` for ``job_id`` now, or None (blocking reads).

    ``pinned`` is what the registration (or discovery, or the checkpoint) recorded.
    """
    if pid <= 1:
        return f"refusing to act on pid {pid}"
    if pid == own_pid:
        return f"refusing to act on pid {pid}: it is the agent itself"
    if pinned is None or pinned.pid != pid:
        return f"pid {pid} is not a registered process of job {job_id}"
    now = identity_of(pid, proc)
    if now is None:
        return f"pid {pid}: no such process"
    if now.start_time != pinned.start_time:
        return (
            f"pid {pid} is another process than the one registered (it started at tick "
            f"{now.start_time}, the registered one at {pinned.start_time}): the pid was reused"
        )
    if (now.uid, now.euid) != (pinned.uid, pinned.euid):
        return (
            f"pid {pid} now runs as uid {now.uid}/{now.euid}, registered as "
            f"{pinned.uid}/{pinned.euid}"
        )
    labels = labels_of(pid, proc)
    if labels is not None and labels.job_id != job_id:
        return f"pid {pid} belongs to job {labels.job_id} by its environment, not {job_id}"
    return None
