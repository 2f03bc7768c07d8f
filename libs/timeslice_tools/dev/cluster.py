"""A local timeslice cluster made of real processes: etcd, N orchestrator replicas, M agents.

Each service runs as ``sys.executable -m timeslice_orchestrator`` / ``-m timeslice_agent``
exactly as a deployment runs it, on free loopback ports, with its output in a log file under
``base_dir/logs``. Used by ``timeslice dev cluster``, the demo and end-to-end tests::

    with LocalCluster(replicas=3, agents=2) as cluster:
        client = TimeSliceOrchestratorClient(cluster.target)
        ...
        cluster.kill_replica(0)    # kill -9, for fault tests
        cluster.start_replica(0)   # back on the same ports

Synchronous on purpose (fixtures, CLI); starting waits for every ``/readyz`` with a deadline
and, when something does not come up, raises :class:`ClusterError` with that process's log tail.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal, TypedDict

from timeslice.agent_contract import BackendKind
from timeslice.tls import CA_ENV, CERT_ENV, INSECURE_ENV, KEY_ENV, TlsFiles
from timeslice_tools.dev import _procs
from timeslice_tools.dev.certs import CertPair, Pki
from timeslice_tools.dev.etcd import EtcdCluster, EtcdServer

__all__ = ["Backend", "ClientTls", "ClusterError", "LocalCluster", "ServiceProcess"]

Backend = str
# The agent's one list of backends (adding one there adds it here and to the CLI).
BACKENDS: tuple[Backend, ...] = tuple(kind.value for kind in BackendKind)

# Unix socket paths are limited to 108 bytes on Linux; leave room for the agent's own suffixes.
_MAX_SOCKET_PATH = 100
_READY_POLL_SECONDS = 0.05
_PORT_RETRIES = 3
_PREFIX_PATTERN = re.compile(r"/[A-Za-z0-9._:/-]*[A-Za-z0-9._:-]")


class ClientTls(TypedDict, total=False):
    """A client's TLS keyword arguments (``AsyncTimeSliceClient(target, **cluster.client_tls)``)."""

    tls_ca: str
    tls_cert: str
    tls_key: str
    insecure: bool


class ClusterError(RuntimeError):
    """A cluster process failed to start or become ready; the message carries its log tail."""


@dataclass
class ServiceProcess:
    """One orchestrator replica or agent: how to start it, where it logs, its live handle."""

    name: str
    kind: Literal["orchestrator", "agent"]
    http: str
    log_path: Path
    grpc: str | None = None
    popen: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None and self.popen.poll() is None else None

    def is_running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


def _format_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _check_prefix(prefix: str) -> str:
    if ".." in prefix or not _PREFIX_PATTERN.fullmatch(prefix):
        raise ValueError(
            f"prefix {prefix!r} is not valid: it must start with '/', not end with '/', and use "
            "only letters, digits, '.', '_', ':', '-' and '/' (no '..')"
        )
    return prefix


class LocalCluster:
    """etcd (own or given) + ``replicas`` orchestrators (r0..) + ``agents`` agents (node-0..).

    Parameters:
        replicas, agents: how many of each to run (``agents`` may be 0).
        backend: the agents' backend (``sim`` models data movement, ``freeze`` SIGSTOPs workers,
            ``app`` lets workers move their own state, ``cuda`` checkpoints GPU processes).
        etcd_endpoint: ``HOST:PORT[,HOST:PORT]`` of an etcd to use; None starts a private one in
            ``base_dir/etcd`` (stopped with the cluster).
        etcd_members: how many members the private etcd has (1: :attr:`etcd`, a single
            :class:`EtcdServer`; more: :attr:`etcd_cluster`, an :class:`EtcdCluster` whose
            every member each replica is given).
        prefix: the etcd key prefix; default ``/timeslice/dev-<random>`` so clusters sharing an
            etcd never see each other.
        session_ttl, replica_ttl: passed to the orchestrators (``replica_ttl`` None: their default).
        base_dir: holds logs, agent sockets and state files; None makes a temporary directory
            that :meth:`stop` removes (pass a directory to keep the logs).
        agent_args, orchestrator_args: extra command-line arguments for every agent / replica
        node_args: extra arguments for one agent by node name (fault injection, say)
            (for example ``["--sim-state-gb", "1"]``).
        env: variables added to the services' environment.
            Replicas get an operator token (``operator_token_file``, made at start) unless
            ``env`` or ``orchestrator_args`` name one.
        ready_timeout: deadline for each start to become ready (``/readyz`` answers 200).
        tls: ``True`` makes a throw-away CA and certificates in ``base_dir/tls``; a
            :class:`~timeslice_tools.dev.certs.Pki` uses those (it must be the given etcd's
            too); ``False`` runs every hop in plaintext (``--insecure``). With TLS, the
            private etcd requires client certificates and auth, replicas serve mutual TLS,
            agents present their node's certificate, :meth:`job_env` holds what a job's
            clients need (its own certificate: it may act as that job only, and has an
            admission bucket and a quota of groups of its own), and :attr:`client_env` what
            an operator's need (the operator certificate, which may act as any job: for the
            operator commands and for tests that play many jobs from one process).
    """

    def __init__(
        self,
        *,
        replicas: int = 1,
        agents: int = 1,
        backend: Backend = "sim",
        etcd_endpoint: str | None = None,
        prefix: str | None = None,
        session_ttl: float = 10,
        replica_ttl: float | None = None,
        base_dir: Path | str | None = None,
        agent_args: Sequence[str] = (),
        node_args: Mapping[str, Sequence[str]] | None = None,
        orchestrator_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        ready_timeout: float = 30.0,
        tls: bool | Pki = False,
        etcd_members: int = 1,
    ) -> None:
        if etcd_members < 1:
            raise ValueError(f"etcd_members must be at least 1, got {etcd_members}")
        if etcd_members > 1 and etcd_endpoint is not None:
            raise ValueError("etcd_members starts a private etcd: give no etcd_endpoint with it")
        if replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {replicas}")
        if agents < 0:
            raise ValueError(f"agents must not be negative, got {agents}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if session_ttl <= 0 or (replica_ttl is not None and replica_ttl <= 0):
            raise ValueError("session_ttl and replica_ttl must be positive")
        if ready_timeout <= 0:
            raise ValueError("ready_timeout must be positive")
        self._prefix = _check_prefix(prefix or f"/timeslice/dev-{secrets.token_hex(4)}")
        self._backend: Backend = backend
        self._session_ttl = session_ttl
        self._replica_ttl = replica_ttl
        self._agent_args = list(agent_args)
        self._node_args = {node: list(args) for node, args in (node_args or {}).items()}
        self._orchestrator_args = list(orchestrator_args)
        self._ready_timeout = ready_timeout
        self._owns_base_dir = base_dir is None
        self._base_dir = (
            Path(tempfile.mkdtemp(prefix="timeslice-dev-")) if base_dir is None else Path(base_dir)
        )
        self._env = dict(os.environ)
        self._env.update(env or {})
        # Services' logs should be current when a test or a user reads them.
        self._env["PYTHONUNBUFFERED"] = "1"
        # Operator commands (pinning members, the operator yield) need a token: a fresh one
        # per cluster, in a file only its user can read, written at start.
        self._operator_token = secrets.token_urlsafe(32)
        self._env.setdefault(
            "TIMESLICE_ORCHESTRATOR_OPERATOR_TOKEN_FILE", str(self.operator_token_file)
        )
        self._given_etcd = etcd_endpoint
        self._pki: Pki | None = (
            tls if isinstance(tls, Pki) else (Pki(self._base_dir / "tls") if tls else None)
        )
        self._etcd: EtcdServer | None = None
        self._etcd_members = etcd_members
        self._etcd_cluster: EtcdCluster | None = None
        self._replicas = [self._new_replica(i) for i in range(replicas)]
        self._agents = {f"node-{i}": self._new_agent(f"node-{i}") for i in range(agents)}
        self._socket_dir, self._owns_socket_dir = self._choose_socket_dir()
        self._started = False
        self._stopped = False

    # -- what tests and clients use ----------------------------------------------------------

    @property
    def operator_token_file(self) -> Path:
        """The file with the replicas' operator token (``timeslice members --token-file``)."""
        return self._base_dir / "operator-token"

    @property
    def operator_token(self) -> str:
        """The operator token itself (for clients that send it as metadata)."""
        return self._operator_token

    @property
    def targets(self) -> list[str]:
        """The orchestrators' gRPC addresses, ``127.0.0.1:PORT``, in replica order."""
        return [r.grpc for r in self._replicas if r.grpc is not None]

    @property
    def target(self) -> str:
        """All orchestrator addresses comma-joined (what ``TIMESLICE_TARGET`` takes)."""
        return ",".join(self.targets)

    @property
    def nodes(self) -> list[str]:
        return list(self._agents)

    @property
    def agent_sockets(self) -> dict[str, Path]:
        """Each node's worker socket (what ``TIMESLICE_AGENT_SOCKET`` takes)."""
        return {node: self._socket_path(node) for node in self._agents}

    @property
    def agent_state_files(self) -> dict[str, Path]:
        return {node: self._node_dir(node) / "state.json" for node in self._agents}

    @property
    def agent_journals(self) -> dict[str, Path]:
        """Per node: the agent's directive journal (one JSON line per finished directive)."""
        return {node: self._node_dir(node) / "journal.jsonl" for node in self._agents}

    @property
    def etcd_endpoint(self) -> str:
        if self._given_etcd is not None:
            return self._given_etcd
        if self._etcd_cluster is not None:
            return self._etcd_cluster.endpoint
        if self._etcd is None:
            raise ClusterError("the cluster's etcd is not started yet")
        return self._etcd.endpoint

    @property
    def etcd(self) -> EtcdServer | None:
        """The private single-member etcd (None when ``etcd_endpoint`` was given, or with
        several members: see :attr:`etcd_cluster`)."""
        return self._etcd

    @property
    def etcd_cluster(self) -> EtcdCluster | None:
        """The private etcd of several members (``etcd_members`` > 1), else None."""
        return self._etcd_cluster

    def _etcd_processes(self) -> dict[str, subprocess.Popen[bytes]]:
        """The private etcd's processes: ``etcd``, or ``etcd-0``.. per member."""
        if self._etcd is not None and self._etcd.process is not None:
            return {"etcd": self._etcd.process}
        if self._etcd_cluster is None:
            return {}
        return {
            f"etcd-{i}": m.process
            for i, m in enumerate(self._etcd_cluster.members)
            if m.process is not None
        }

    @property
    def pki(self) -> Pki | None:
        """The cluster's certificates (None: plaintext)."""
        return self._pki

    @property
    def client_env(self) -> dict[str, str]:
        """What an operator's client of this cluster needs in its environment (``timeslice
        groups``, ``status``, ``top``, ``members``): the CA and the operator certificate, or
        plaintext (which also blanks TLS files the environment may name, since files win
        over it). A job's clients take :meth:`job_env`."""
        return self._env_of(None if self._pki is None else self._pki.operator)

    @property
    def client_tls(self) -> ClientTls:
        """:attr:`client_env` as keyword arguments of ``AsyncTimeSliceClient`` /
        ``TimeSliceClient``."""
        return self._tls_of(None if self._pki is None else self._pki.operator)

    def job_env(self, job: str) -> dict[str, str]:
        """What the clients of job ``job`` need in their environment: the CA and the job's
        own certificate (issued on first use; it may act as ``job`` only), or plaintext."""
        return self._env_of(self._job_pair(job))

    def job_tls(self, job: str) -> ClientTls:
        """:meth:`job_env` as keyword arguments of ``AsyncTimeSliceClient`` /
        ``TimeSliceClient``."""
        return self._tls_of(self._job_pair(job))

    def _job_pair(self, job: str) -> CertPair | None:
        if self._pki is None:
            return None
        try:
            return self._pki.job(job)
        except FileNotFoundError as exc:  # a --certs directory without the CA's key
            raise ClusterError(
                f"no certificate for job {job!r} in {self._pki.directory}, and no CA key there "
                f"to issue one ({exc.filename}; a cluster's own CA is made when it starts): "
                f"issue job-{job}.crt/.key from your CA"
            ) from None

    def _env_of(self, pair: CertPair | None) -> dict[str, str]:
        if self._pki is None or pair is None:
            return {INSECURE_ENV: "1", CA_ENV: "", CERT_ENV: "", KEY_ENV: ""}
        return {CA_ENV: str(self._pki.ca), CERT_ENV: str(pair.cert), KEY_ENV: str(pair.key)}

    def _tls_of(self, pair: CertPair | None) -> ClientTls:
        if self._pki is None or pair is None:
            return ClientTls(insecure=True)
        return ClientTls(tls_ca=str(self._pki.ca), tls_cert=str(pair.cert), tls_key=str(pair.key))

    @property
    def etcd_tls(self) -> TlsFiles | None:
        """What the replicas present to etcd (for tools that read etcd as they do); None:
        plaintext etcd."""
        if self._pki is None:
            return None
        pair = self._pki.etcd_client
        return TlsFiles(str(self._pki.etcd_ca), str(pair.cert), str(pair.key))

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def base_dir(self) -> Path:
        return self._base_dir

    @property
    def log_dir(self) -> Path:
        return self._base_dir / "logs"

    @property
    def replica_ids(self) -> list[str]:
        return [r.name for r in self._replicas]

    @property
    def replica_http(self) -> list[str]:
        """Each replica's HTTP address (health, metrics, dashboard), in replica order."""
        return [r.http for r in self._replicas]

    @property
    def dashboard_urls(self) -> dict[str, str]:
        """Each replica's live dashboard (``/`` of its HTTP port), by replica id."""
        return {r.name: f"http://{r.http}/" for r in self._replicas}

    @property
    def agent_http(self) -> dict[str, str]:
        return {node: a.http for node, a in self._agents.items()}

    @property
    def services(self) -> dict[str, ServiceProcess]:
        """Every replica (by replica id) and agent (by node) with ports, log and handle."""
        out = {r.name: r for r in self._replicas}
        out.update(self._agents)
        return out

    @property
    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        """Live-or-exited process handles by name (``r0``.., ``node-0``.., and ``etcd``, or
        ``etcd-0``.. for each member of a private etcd cluster)."""
        out = {name: s.popen for name, s in self.services.items() if s.popen is not None}
        out.update(self._etcd_processes())
        return out

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> LocalCluster:
        """Start etcd (unless given), every replica, then every agent; wait until all are ready.

        On failure everything started so far is stopped and :class:`ClusterError` is raised.
        """
        if self._started:
            raise ClusterError("the cluster was already started; a LocalCluster starts once")
        self._started = True
        try:
            self._base_dir.mkdir(parents=True, exist_ok=True)
            self.log_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.operator_token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self._operator_token + "\n")
            if self._pki is not None and not self._pki.ca.exists():
                self._pki = Pki.create(self._pki.directory, nodes=list(self._agents))
            if self._pki is not None and not self._pki.etcd_ca.exists():
                raise ClusterError(
                    f"{self._pki.directory} has no etcd CA ({self._pki.etcd_ca.name}): it was "
                    "made with one CA for etcd and everything else; run `timeslice dev certs "
                    f"--out {self._pki.directory} --split-etcd-ca` (docs/security.md)"
                )
            if self._given_etcd is None and self._etcd_members > 1:
                self._etcd_cluster = EtcdCluster(
                    self._etcd_members, self._base_dir / "etcd", tls=self._pki
                )
                self._etcd_cluster.start()
            elif self._given_etcd is None:
                self._etcd = EtcdServer(self._base_dir / "etcd", tls=self._pki)
                self._etcd.start()
            self._start_batch(self._replicas)
            for node in self._agents:
                self._node_dir(node).mkdir(parents=True, exist_ok=True)
                self._socket_path(node).parent.mkdir(parents=True, exist_ok=True)
            self._start_batch(list(self._agents.values()))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Stop agents, then replicas, then the private etcd (SIGTERM, SIGKILL after ``grace``).

        Idempotent. Removes ``base_dir`` when the cluster created it.
        """
        if self._stopped:
            return
        self._stopped = True
        # Agents first so they do not spend the shutdown reconnecting to dying replicas.
        _procs.terminate_all(
            [a.popen for a in self._agents.values() if a.popen is not None], grace=grace
        )
        _procs.terminate_all([r.popen for r in self._replicas if r.popen is not None], grace=grace)
        if self._etcd is not None:
            self._etcd.stop(grace=grace)
        if self._etcd_cluster is not None:
            self._etcd_cluster.stop(grace=grace)
        if self._owns_socket_dir:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
        if self._owns_base_dir:
            shutil.rmtree(self._base_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        if not self._started:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def exited(self) -> dict[str, int]:
        """Services that have exited since they were started, with their exit status."""
        out: dict[str, int] = {}
        for name, service in self.services.items():
            if service.popen is not None:
                code = service.popen.poll()
                if code is not None:
                    out[name] = code
        for name, process in self._etcd_processes().items():
            code = process.poll()
            if code is not None:
                out[name] = code
        return out

    def log_tail(self, name: str, max_lines: int = 40) -> str:
        """The end of a service's log (``r0``, ``node-0``, ``etcd``, or ``etcd-0``..)."""
        if name.startswith("etcd-") and self._etcd_cluster is not None:
            member = self._etcd_cluster.members[int(name.removeprefix("etcd-"))]
            return _procs.log_tail(member.log_path, max_lines)
        if name == "etcd":
            if self._etcd is None:
                raise KeyError("this cluster uses an external etcd")
            return _procs.log_tail(self._etcd.log_path, max_lines)
        return _procs.log_tail(self.services[name].log_path, max_lines)

    # -- fault injection ---------------------------------------------------------------------

    def kill_replica(self, index: int) -> None:
        """SIGKILL replica ``index`` (a crash: no cleanup, its etcd leases expire on their own)."""
        _procs.kill(self._replica(index).popen or self._not_started(f"r{index}"))

    def stop_replica(self, index: int, grace: float = 5.0) -> None:
        """SIGTERM replica ``index`` and wait for it (SIGKILL after ``grace``)."""
        _procs.terminate_all([self._replica(index).popen or self._not_started(f"r{index}")], grace)

    def start_replica(self, index: int) -> None:
        """Start replica ``index`` again on its ports and wait until it is ready."""
        replica = self._replica(index)
        if replica.is_running():
            raise ClusterError(f"replica {replica.name} is still running (pid {replica.pid})")
        self._launch(replica)
        self._wait_ready([replica])

    def kill_agent(self, node: str) -> None:
        """SIGKILL the agent of ``node``; its state file stays for the restart to reconcile."""
        _procs.kill(self._agent(node).popen or self._not_started(node))

    def stop_agent(self, node: str, grace: float = 5.0) -> None:
        _procs.terminate_all([self._agent(node).popen or self._not_started(node)], grace)

    def start_agent(self, node: str) -> None:
        """Start the agent of ``node`` again (same socket, state file and port); wait for ready."""
        agent = self._agent(node)
        if agent.is_running():
            raise ClusterError(f"agent {node} is still running (pid {agent.pid})")
        self._launch(agent)
        self._wait_ready([agent])

    # -- internals ---------------------------------------------------------------------------

    def _replica(self, index: int) -> ServiceProcess:
        if not 0 <= index < len(self._replicas):
            raise IndexError(f"no replica {index}: the cluster has {len(self._replicas)}")
        return self._replicas[index]

    def _agent(self, node: str) -> ServiceProcess:
        try:
            return self._agents[node]
        except KeyError:
            raise KeyError(
                f"no agent for node {node!r}; nodes: {', '.join(self._agents)}"
            ) from None

    @staticmethod
    def _not_started(name: str) -> subprocess.Popen[bytes]:
        raise ClusterError(f"{name} was never started")

    def _new_replica(self, index: int) -> ServiceProcess:
        grpc_port, http_port = _procs.free_ports(2)
        return ServiceProcess(
            name=f"r{index}",
            kind="orchestrator",
            grpc=f"127.0.0.1:{grpc_port}",
            http=f"127.0.0.1:{http_port}",
            log_path=self.log_dir / f"r{index}.log",
        )

    def _new_agent(self, node: str) -> ServiceProcess:
        (http_port,) = _procs.free_ports(1)
        return ServiceProcess(
            name=node,
            kind="agent",
            http=f"127.0.0.1:{http_port}",
            log_path=self.log_dir / f"{node}.log",
        )

    def _node_dir(self, node: str) -> Path:
        return self._base_dir / "agents" / node

    def _socket_path(self, node: str) -> Path:
        return self._socket_dir / node / "worker.sock"

    def _choose_socket_dir(self) -> tuple[Path, bool]:
        preferred = self._base_dir / "agents"
        longest = max((len(node) for node in self._agents), default=0)
        if len(str(preferred)) + longest + len("//worker.sock") <= _MAX_SOCKET_PATH:
            return preferred, False
        # A deep base_dir (pytest's tmp_path, say) would overflow sun_path.
        return Path(tempfile.mkdtemp(prefix="ts-", dir="/tmp")), True

    def _argv(self, service: ServiceProcess) -> list[str]:
        if service.kind == "orchestrator":
            assert service.grpc is not None
            argv = [
                sys.executable, "-m", "timeslice_orchestrator",
                "--listen", service.grpc,
                "--http", service.http,
                "--etcd", self.etcd_endpoint,
                "--prefix", self._prefix,
                "--replica-id", service.name,
                "--session-ttl", _format_seconds(self._session_ttl),
            ]  # fmt: skip
            if self._replica_ttl is not None:
                argv += ["--replica-ttl", _format_seconds(self._replica_ttl)]
            return argv + self._tls_args(service) + self._orchestrator_args
        # Each agent starts on a different replica (node-i on replica i mod N), as agents
        # spread behind a load balancer would; the rest of the list is its failover order.
        index = list(self._agents).index(service.name)
        shift = index % len(self.targets)
        targets = self.targets[shift:] + self.targets[:shift]
        return [
            sys.executable, "-m", "timeslice_agent",
            "--orchestrator", ",".join(targets),
            "--node", service.name,
            "--backend", self._backend,
            "--worker-socket", str(self._socket_path(service.name)),
            "--state-file", str(self.agent_state_files[service.name]),
            "--http", service.http,
            "--journal", str(self.agent_journals[service.name]),
            # Agents of a dev cluster share one host's processes, so discovery by environment
            # cannot tell their nodes apart unless processes carry TIMESLICE_NODE: opt in with
            # agent_args=["--discover", "procfs"] (a later option wins).
            "--discover", "off",
            *self._tls_args(service),
            *self._agent_args,
            *self._node_args.get(service.name, []),
        ]  # fmt: skip

    def _tls_args(self, service: ServiceProcess) -> list[str]:
        pki = self._pki
        if pki is None:
            return ["--insecure"]
        if service.kind == "orchestrator":
            return [
                "--tls-cert", str(pki.orchestrator.cert),
                "--tls-key", str(pki.orchestrator.key),
                "--tls-ca", str(pki.ca),
                "--etcd-ca", str(pki.etcd_ca),
                "--etcd-cert", str(pki.etcd_client.cert),
                "--etcd-key", str(pki.etcd_client.key),
            ]  # fmt: skip
        node = pki.node(service.name)
        return ["--tls-ca", str(pki.ca), "--tls-cert", str(node.cert), "--tls-key", str(node.key)]

    def _launch(self, service: ServiceProcess) -> None:
        service.popen = _procs.spawn(self._argv(service), service.log_path, env=self._env)

    def _start_batch(self, services: list[ServiceProcess]) -> None:
        """Launch all of ``services`` at once and wait for them; move to new ports if taken."""
        offsets = {s.name: _procs.log_size(s.log_path) for s in services}
        for service in services:
            self._launch(service)
        retries_left = _PORT_RETRIES - 1
        while True:
            try:
                self._wait_ready(services)
                return
            except ClusterError:
                clashed = [
                    s
                    for s in services
                    if not s.is_running()
                    and _procs.address_in_use(_procs.log_since(s.log_path, offsets[s.name]))
                ]
                if retries_left == 0 or not clashed:
                    raise
                retries_left -= 1
                for service in clashed:
                    # Only a start that never became ready moves ports: nobody knows them yet.
                    ports = _procs.free_ports(2)
                    if service.grpc is not None:
                        service.grpc = f"127.0.0.1:{ports[1]}"
                    service.http = f"127.0.0.1:{ports[0]}"
                    offsets[service.name] = _procs.log_size(service.log_path)
                    self._launch(service)

    def _wait_ready(self, services: list[ServiceProcess]) -> None:
        deadline = time.monotonic() + self._ready_timeout
        pending = list(services)
        last: dict[str, str] = {}
        while pending:
            for service in list(pending):
                assert service.popen is not None
                code = service.popen.poll()
                if code is not None:
                    raise ClusterError(
                        f"{service.kind} {service.name} exited with status {code} before it was "
                        f"ready; log {service.log_path}:\n{_procs.log_tail(service.log_path)}"
                    )
                answer = _procs.http_status(f"http://{service.http}/readyz", timeout=0.5)
                if answer is not None and answer[0] == 200:
                    pending.remove(service)
                elif answer is not None:
                    last[service.name] = f"HTTP {answer[0]}"
            if not pending:
                return
            if time.monotonic() >= deadline:
                service = pending[0]
                raise ClusterError(
                    f"{service.kind} {service.name} not ready after {self._ready_timeout:g} s "
                    f"(GET http://{service.http}/readyz: {last.get(service.name, 'no answer')}); "
                    f"log {service.log_path}:\n{_procs.log_tail(service.log_path)}"
                )
            time.sleep(_READY_POLL_SECONDS)

    def __repr__(self) -> str:
        return (
            f"LocalCluster(replicas={len(self._replicas)}, agents={len(self._agents)}, "
            f"backend={self._backend!r}, prefix={self._prefix!r}, base_dir={str(self._base_dir)!r})"
        )
