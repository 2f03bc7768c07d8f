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

**Pids are translated from the registrant's pid namespace.** A job's pod usually has a pid
namespace of its own while the agent runs with ``hostPID``: the worker sends the pid it sees
(``os.getpid()`` in the pod), the kernel reports its pid in the agent's namespace. When the peer
lives in another pid namespace than the agent (``/proc/<pid>/ns/pid``), the registered pid is
read in the *peer's* namespace and mapped to the agent's through ``NSpid:`` in
``/proc/<pid>/status`` (its last entry is the pid in the process's own namespace): it names the
peer itself, or a descendant of the peer in the same namespace whose innermost pid it is. From
then on only that process (its pid in the agent's namespace) is recorded and acted on; a pid of
the agent's namespace that happens to equal the registered number is never considered. A kernel
without ``NSpid`` (before Linux 4.1) cannot translate: such registrations are refused, with the
reason. The SDK also sends ``registrant_pid`` (its own pid as it sees it): if it is not the
connecting process's innermost pid, the message did not come from the process that connected,
or came from a namespace the agent cannot see, and the registration is refused.

Every refusal carries a ``reason`` (:data:`REFUSAL_REASONS`), counted in
``timeslice_agent_registrations_refused_total``.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpclib.server

from timeslice.errors import PermissionDenied
from timeslice_agent.discovery import labels_of
from timeslice_agent.procs import (
    PROC,
    ProcessIdentity,
    ProcWalkTimeout,
    descendants_of,
    descends_from,
    identity_of,
    nspid_of,
    pid_namespace,
)

# struct ucred { pid_t pid; uid_t uid; gid_t gid; }
_UCRED = struct.Struct("iII")
# Not in Python 3.11's socket module; the value is the same on every Linux architecture.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


# Why a registration was refused: the ``reason`` label of the refusal counter.
REFUSAL_REASONS = (
    "invalid",  # malformed ids or pid, or the job is registered in another group
    "credentials",  # not over the unix socket, or the kernel named no peer
    "connector_gone",  # the process that connected exited or changed identity
    "forbidden_pid",  # pid 0, 1 or the agent itself
    "no_such_process",
    "foreign_uid",  # a non-root peer named another user's process
    "not_descendant",  # neither the peer nor one of its descendants
    "other_job",  # labelled for another job by its environment
    "changed",  # the process changed while it was being checked
    "namespace",  # from another pid namespace, and the pid cannot be translated
    "registrant_mismatch",  # registrant_pid is not the connecting process
    "timeout",  # the /proc reads took too long
    "other",
)


class RegistrationRefused(PermissionDenied):
    """A registration the agent refuses; ``reason`` is one of :data:`REFUSAL_REASONS`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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
        raise RegistrationRefused(
            "credentials", f"cannot read the peer's credentials: {exc}"
        ) from None
    pid, uid, gid = _UCRED.unpack(raw)
    if pid <= 0:
        raise RegistrationRefused(
            "credentials",
            "the kernel reported no peer process for this connection (a process in a pid "
            "namespace the agent cannot see?)",
        )
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
                        raise RegistrationRefused(
                            "connector_gone",
                            f"the process that connected (pid {pid}) has exited; its "
                            "connection cannot register workers",
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
        raise RegistrationRefused(
            "credentials", "registrations are accepted only over the agent's unix socket"
        )
    return credentials_of_socket(sock)


def authorize_registration(
    peer: PeerCredentials,
    pid: int,
    job_id: str,
    *,
    own_pid: int,
    registrant_pid: int = 0,
    proc: Path = PROC,
    deadline: float | None = None,
) -> ProcessIdentity:
    """Pin the process ``pid`` names for ``peer``, or raise RegistrationRefused (blocking reads).

    ``pid`` is read in the peer's pid namespace; the identity returned is the process's in the
    agent's (its ``pid`` is what the agent records and acts on). ``registrant_pid``: what the
    registrant says its own pid is (0: not said). ``deadline`` (``time.monotonic()``) bounds a
    walk of /proc. See the module docstring for the rules.
    """
    host_pid = resolve_pid(peer, pid, registrant_pid=registrant_pid, proc=proc, deadline=deadline)
    said = pid if host_pid == pid else f"{pid} (pid {host_pid} on the node)"
    if host_pid <= 1 or host_pid == own_pid:
        raise RegistrationRefused("forbidden_pid", f"pid {said} cannot be registered")
    target = identity_of(host_pid, proc)
    if target is None:
        raise RegistrationRefused("no_such_process", f"pid {said}: no such process")
    connector = identity_of(peer.pid, proc)
    if connector is None or connector.euid != peer.uid:
        raise RegistrationRefused(
            "connector_gone",
            f"the process that connected (pid {peer.pid}) is gone or changed its identity",
        )
    if peer.uid != 0 and (target.uid != peer.uid or target.euid != peer.uid):
        raise RegistrationRefused(
            "foreign_uid",
            f"pid {said} runs as uid {target.uid}/{target.euid}; a worker of uid {peer.uid} "
            "may only register its own processes",
        )
    if not descends_from(host_pid, peer.pid, proc):
        raise RegistrationRefused(
            "not_descendant",
            f"pid {said} is neither the registering process (pid {peer.pid}) nor one of its "
            "descendants",
        )
    labels = labels_of(host_pid, proc)
    if labels is not None and labels.job_id != job_id:
        raise RegistrationRefused(
            "other_job",
            f"pid {said} belongs to job {labels.job_id} by its environment (TIMESLICE_JOB_ID); "
            f"it cannot be registered for job {job_id}",
        )
    # The chain was read over several reads: if the pid changed hands meanwhile, refuse. (A
    # process keeps its pid namespace and its pids for life: the same start time at the same
    # host pid is the same process, so the translation still holds.)
    if identity_of(host_pid, proc) != target:
        raise RegistrationRefused("changed", f"pid {said} changed while it was being checked")
    return target


def resolve_pid(
    peer: PeerCredentials,
    pid: int,
    *,
    registrant_pid: int = 0,
    proc: Path = PROC,
    deadline: float | None = None,
) -> int:
    """The pid, in the agent's namespace, of the process ``peer`` calls ``pid`` in its own.

    Raises RegistrationRefused if there is none (blocking reads; see the module docstring).
    """
    peer_chain = nspid_of(peer.pid, proc)
    if peer_chain is None:
        raise RegistrationRefused(
            "connector_gone", f"the process that connected (pid {peer.pid}) is gone"
        )
    own_ns = pid_namespace("self", proc)
    peer_ns = pid_namespace(peer.pid, proc)
    if not peer_chain:
        # No NSpid (Linux < 4.1): another namespace shows as another ns inode, or as a
        # registrant whose own pid is not the one the kernel reports.
        elsewhere = (own_ns is not None and peer_ns is not None and own_ns != peer_ns) or (
            registrant_pid != 0 and registrant_pid != peer.pid
        )
        if elsewhere:
            raise RegistrationRefused(
                "namespace",
                f"the registering process (pid {peer.pid} on the node) runs in another pid "
                "namespace than the agent, and this kernel reports no NSpid in "
                f"/proc/{peer.pid}/status (Linux 4.1 or later does), so pid {pid} of its "
                "namespace cannot be translated; run the pod with hostPID, or on a newer kernel",
            )
        return pid
    own_chain = nspid_of("self", proc) or (0,)
    if own_ns is not None and peer_ns is not None:
        same = own_ns == peer_ns
    else:
        same = len(peer_chain) == len(own_chain)
    innermost = peer_chain[-1]
    if registrant_pid != 0 and registrant_pid != innermost:
        raise RegistrationRefused(
            "registrant_mismatch",
            f"the registration says it comes from pid {registrant_pid}, but the process that "
            f"connected is pid {innermost} in its pid namespace (pid {peer.pid} on the node): "
            "register from the process that connected",
        )
    if same:
        return pid
    if pid == innermost:
        return peer.pid
    # A descendant in the peer's namespace whose innermost pid is ``pid``: pids are unique
    # within a namespace, so there is at most one (more means the walk saw a pid reused).
    found: list[int] = []
    try:
        for candidate in descendants_of(peer.pid, proc, deadline=deadline):
            chain = nspid_of(candidate, proc)
            if chain and chain[-1] == pid and pid_namespace(candidate, proc) == peer_ns:
                found.append(candidate)
            if deadline is not None and time.monotonic() > deadline:
                raise ProcWalkTimeout("reading the descendants' NSpid took too long")
    except ProcWalkTimeout as exc:
        raise RegistrationRefused(
            "timeout", f"translating pid {pid} from the worker's pid namespace: {exc}"
        ) from None
    if len(found) > 1:
        raise RegistrationRefused(
            "changed",
            f"pid {pid} of the registering process's pid namespace named several processes "
            f"({found}) while it was being checked",
        )
    if not found:
        raise RegistrationRefused(
            "not_descendant",
            f"pid {pid} of the registering process's pid namespace is neither the registering "
            f"process (pid {innermost} there, {peer.pid} on the node) nor one of its "
            "descendants in that namespace",
        )
    return found[0]


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
