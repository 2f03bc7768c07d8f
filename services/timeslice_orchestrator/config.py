"""Settings of one orchestrator replica, from flags or environment variables.

Every option ``--some-name`` can also be given as ``TIMESLICE_ORCHESTRATOR_SOME_NAME`` (the
agent's options likewise as ``TIMESLICE_AGENT_SOME_NAME``); the command line wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from timeslice.argv import OneLineParser
from timeslice.targets import HostPort, parse_address
from timeslice.tls import TlsFiles
from timeslice_orchestrator.dashboard import DashboardConfig
from timeslice_orchestrator.identity import RESERVED_NAMES, IdentityRules, JobSource
from timeslice_orchestrator.limits import Limits
from timeslice_orchestrator.policy import Policy
from timeslice_orchestrator.store.etcd import MemberProbe, parse_endpoints
from timeslice_orchestrator.tls import ConnectionLimits

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Address:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Address:
        # InvalidArgument is a ValueError; ":PORT" listens on every interface.
        host, port = parse_address(text, default_host="0.0.0.0", port_zero=True)
        return cls(host, port)

    def __str__(self) -> str:
        return str(HostPort(self.host, self.port))


@dataclass(frozen=True, slots=True)
class OrchestratorConfig:
    listen: Address
    http: Address
    etcd: list[str]
    prefix: str
    replica_id: str
    session_ttl: int
    replica_ttl: int
    agent_ttl: int
    directive_timeout: float
    agent_liveness_timeout: float
    co_residency: bool
    prefetch: bool
    policy: Policy
    max_hold: float
    # A file holding the operator token (operator RPCs need it); "": no operator token.
    operator_token_file: str = ""
    tls: TlsFiles | None = None
    """The gRPC port's certificate, key and client CA; None: plaintext (``--insecure``)."""
    etcd_tls: TlsFiles | None = None
    """The CA of etcd's server certificate and our client certificate; None: plaintext."""
    identity: IdentityRules = field(default_factory=IdentityRules)
    insecure: bool = False
    limits: Limits = field(default_factory=Limits)
    start_timeout: float = 30.0
    """How long start-up waits for etcd (its lease, then its first full read) before the
    process gives up with one line; a supervisor (systemd, Kubernetes) restarts it."""
    etcd_timeout: float = 5.0
    """The deadline of each etcd call, in seconds."""
    etcd_probe: MemberProbe = field(default_factory=MemberProbe)
    """When an etcd member with calls waiting is asked whether it still serves them, and how
    long it has to answer (store/etcd.py)."""
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    """What one peer may hold on the gRPC port with TLS: pending handshakes, deadlines,
    connections per identity, idle connections (tls.py, docs/security.md)."""
    """Limits of the dashboard on the HTTP port (docs/dashboard.md)."""
    compat_hold_ttl: int = 10
    """TTL of the implicit sessions of v1alpha1 (llm-d) clients: how long a hold outlives
    its client's connection at most (docs/migrating-from-llm-d.md)."""


ENV_PREFIX = "TIMESLICE_ORCHESTRATOR_"
# Before one naming scheme (TIMESLICE_<SERVICE>_<OPTION>, as the agent's), the orchestrator
# read TIMESLICE_<OPTION>; those names still work, with a warning, so no deployment breaks.
_LEGACY_PREFIX = "TIMESLICE_"


def _env(name: str, default: str, *, legacy_name: bool = True) -> str:
    value = os.environ.get(ENV_PREFIX + name)
    if value is not None:
        return value
    if not legacy_name:
        # Options newer than the scheme have no old name; TIMESLICE_TLS_* are the SDK's.
        return default
    legacy = os.environ.get(_LEGACY_PREFIX + name)
    if legacy is not None:
        log.warning("%s%s is deprecated: use %s%s", _LEGACY_PREFIX, name, ENV_PREFIX, name)
        return legacy
    return default


def _env_flag(name: str, *, legacy_name: bool = True) -> bool:
    value = _env(name, "false", legacy_name=legacy_name)
    return value.strip().lower() in ("1", "true", "yes", "on")


def parse_args(argv: Sequence[str] | None = None) -> OrchestratorConfig:
    p = OneLineParser(prog="timeslice orchestrator", description=__doc__)
    p.add_argument("--listen", default=_env("LISTEN", "0.0.0.0:50051"), help="gRPC HOST:PORT")
    p.add_argument(
        "--http",
        default=_env("HTTP", "0.0.0.0:8080"),
        help="health, metrics and dashboard HOST:PORT (plaintext, unauthenticated: bind it to "
        "a trusted network)",
    )
    p.add_argument(
        "--dashboard-max-streams",
        type=int,
        default=_env("DASHBOARD_MAX_STREAMS", "256", legacy_name=False),
        help="dashboard event streams open at once; more get 503 (0: the page cannot stream)",
    )
    p.add_argument(
        "--dashboard-stuck-seconds",
        type=float,
        default=_env("DASHBOARD_STUCK_SECONDS", "10", legacy_name=False),
        help="a dashboard stream whose write takes longer (its browser stopped reading) is dropped",
    )
    p.add_argument(
        "--etcd",
        default=_env("ETCD", "127.0.0.1:2379"),
        help="comma-separated etcd HOST:PORT endpoints",
    )
    p.add_argument(
        "--prefix",
        default=_env("PREFIX", "/timeslice/default"),
        help="etcd key prefix of this deployment",
    )
    p.add_argument(
        "--replica-id",
        default=_env("REPLICA_ID", ""),
        help="unique name of this replica (default: host-random)",
    )
    p.add_argument(
        "--session-ttl",
        type=int,
        default=_env("SESSION_TTL", "10"),
        help="default client session lease TTL, seconds",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=_env("START_TIMEOUT", "30", legacy_name=False),
        help="seconds start-up waits for etcd before giving up (default 30)",
    )
    p.add_argument(
        "--etcd-timeout",
        type=float,
        default=_env("ETCD_TIMEOUT", "5", legacy_name=False),
        help="deadline of each etcd call, seconds (default 5)",
    )
    p.add_argument(
        "--etcd-probe-after",
        type=float,
        default=_env("ETCD_PROBE_AFTER", "0.5", legacy_name=False),
        help="an etcd call unanswered this long has its member asked for its status; a member "
        "that does not answer, or has lost its leader, is left and its calls end at once "
        "(seconds, default 0.5; 0: off, calls wait for their deadline)",
    )
    p.add_argument(
        "--etcd-probe-timeout",
        type=float,
        default=_env("ETCD_PROBE_TIMEOUT", "0.5", legacy_name=False),
        help="seconds an etcd member has to answer that status probe (default 0.5)",
    )
    p.add_argument(
        "--compat-hold-ttl",
        type=int,
        default=_env("COMPAT_HOLD_TTL", "10", legacy_name=False),
        help="v1alpha1 (llm-d) clients: a hold lapses at most this many seconds after its "
        "client's connection closes",
    )
    p.add_argument(
        "--replica-ttl",
        type=int,
        default=_env("REPLICA_TTL", "5"),
        help="this replica's lease TTL: how fast others take over its groups",
    )
    p.add_argument(
        "--agent-ttl",
        type=int,
        default=_env("AGENT_TTL", "10"),
        help="how long a node stays in its groups after its agent's stream drops, seconds",
    )
    p.add_argument(
        "--directive-timeout",
        type=float,
        default=_env("DIRECTIVE_TIMEOUT", "30"),
        help="deadline of one checkpoint/restore directive on a node, seconds",
    )
    p.add_argument(
        "--agent-liveness-timeout",
        type=float,
        default=_env("AGENT_LIVENESS_TIMEOUT", "4"),
        help="an agent silent this long (no heartbeat) is fenced out of its groups, seconds; "
        "0 turns heartbeats off (then only a missed directive deadline fences a node)",
    )
    p.add_argument(
        "--co-residency",
        action=argparse.BooleanOptionalAction,
        default=_env_flag("CO_RESIDENCY"),
        help="keep an idle job's state on the devices while the next job fits next to it "
        "(needs honest state_bytes that include each job's peak working memory)",
    )
    p.add_argument(
        "--prefetch",
        action=argparse.BooleanOptionalAction,
        default=_env_flag("PREFETCH"),
        help="restore the next waiter's state while the holder still runs, when it fits "
        "beside it (device capacity reported by the agents)",
    )
    p.add_argument(
        "--policy",
        choices=[x.value for x in Policy],
        default=_env("POLICY", "fifo"),
        help="which waiter a group serves next",
    )
    p.add_argument(
        "--max-hold",
        type=float,
        default=_env("MAX_HOLD", "0"),
        help="seconds after which a holder is asked (co-operatively) to yield when others "
        "wait; 0 = never",
    )
    p.add_argument(
        "--operator-token-file",
        default=_env("OPERATOR_TOKEN_FILE", ""),
        help="file with the operator token: SetGroupMembers and the operator yield need it "
        "as gRPC metadata 'authorization: Bearer <token>', or an operator certificate",
    )
    tls = p.add_argument_group(
        "TLS", "certificates are PEM files, reloaded when they change (new connections use them)"
    )
    for flag, name, what in (
        ("--tls-cert", "TLS_CERT", "this replica's server certificate (chain)"),
        ("--tls-key", "TLS_KEY", "its private key"),
        ("--tls-ca", "TLS_CA", "the CA that signs clients' and agents' certificates"),
        ("--etcd-ca", "ETCD_CA", "the CA of etcd's server certificate (turns etcd TLS on)"),
        ("--etcd-cert", "ETCD_CERT", "our client certificate towards etcd (its CN: the user)"),
        ("--etcd-key", "ETCD_KEY", "its private key"),
    ):
        tls.add_argument(flag, default=_env(name, "", legacy_name=False) or None, help=what)
    tls.add_argument(
        "--tls-job-identity",
        choices=[x.value for x in JobSource],
        default=_env("TLS_JOB_IDENTITY", "uri", legacy_name=False),
        help="where a job's client certificate names its job: SAN URI timeslice://job/<id>, "
        "the first DNS SAN, or the subject CN",
    )
    tls.add_argument(
        "--tls-operator-ou",
        default=_env("TLS_OPERATOR_OU", "", legacy_name=False),
        metavar="OU",
        help="make a client certificate with this subject OU an operator (besides SAN URI "
        "timeslice://operator); off unless given: whoever may issue a job certificate with "
        "that OU would otherwise issue an operator",
    )
    tls.add_argument(
        "--tls-reserved-names",
        default=_env("TLS_RESERVED_NAMES", "", legacy_name=False),
        metavar="NAME[,NAME]",
        help="etcd users besides root and timeslice (always reserved): a client certificate "
        "whose CN, job or node is one of them is refused every call",
    )
    tls.add_argument(
        "--insecure",
        action="store_true",
        default=_env_flag("INSECURE", legacy_name=False),
        help="allow plaintext where no certificate is given (gRPC port, etcd): development only",
    )
    _add_connection_limits(p)
    _add_limits(p)
    a = p.parse_args(argv)
    try:
        listen, http = Address.parse(a.listen), Address.parse(a.http)
    except ValueError as exc:
        p.error(str(exc))
    try:
        dashboard = DashboardConfig(
            max_streams=a.dashboard_max_streams, stuck_seconds=a.dashboard_stuck_seconds
        )
    except ValueError as exc:
        p.error(f"--dashboard-*: {exc}")
    if a.session_ttl < 1 or a.replica_ttl < 1 or a.agent_ttl < 1 or a.compat_hold_ttl < 1:
        p.error("TTLs must be at least 1 second")
    try:
        etcd = parse_endpoints([a.etcd])
    except ValueError as exc:
        p.error(str(exc))
    if not 0 < a.start_timeout <= 3600:
        p.error("--start-timeout must be between 0 and 3600 seconds")
    if not 0 < a.etcd_timeout <= 3600:
        p.error("--etcd-timeout must be between 0 and 3600 seconds")
    try:
        etcd_probe = MemberProbe(after=a.etcd_probe_after, timeout=a.etcd_probe_timeout)
    except ValueError as exc:
        p.error(f"--etcd-probe-after/--etcd-probe-timeout: {exc}")
    if etcd_probe.enabled and etcd_probe.after + etcd_probe.timeout >= a.etcd_timeout:
        p.error(
            "--etcd-probe-after plus --etcd-probe-timeout must be less than --etcd-timeout: "
            "a probe must be able to end a call before its deadline does"
        )
    if a.agent_liveness_timeout < 0 or a.agent_liveness_timeout > 3600:
        p.error("--agent-liveness-timeout must be between 0 and 3600 seconds")
    try:
        server_tls = (
            None if a.tls_cert is None and a.tls_key is None and a.tls_ca is None
            else TlsFiles(a.tls_ca or "", a.tls_cert, a.tls_key)
        )  # fmt: skip
        etcd_tls = (
            None if a.etcd_ca is None and a.etcd_cert is None and a.etcd_key is None
            else TlsFiles(a.etcd_ca or "", a.etcd_cert, a.etcd_key)
        )  # fmt: skip
    except ValueError as exc:
        p.error(str(exc))
    if server_tls is not None and not (server_tls.ca and server_tls.cert):
        p.error("--tls-cert, --tls-key and --tls-ca go together (mutual TLS)")
    if etcd_tls is not None and not etcd_tls.ca:
        p.error("--etcd-cert and --etcd-key need --etcd-ca")
    if (server_tls is None or etcd_tls is None) and not a.insecure:
        plain = [w for w, t in (("the gRPC port", server_tls), ("etcd", etcd_tls)) if t is None]
        p.error(
            f"no TLS for {' and '.join(plain)}: give --tls-cert/--tls-key/--tls-ca and "
            "--etcd-ca/--etcd-cert/--etcd-key, or --insecure to run in plaintext"
        )
    replica_id = a.replica_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
    return OrchestratorConfig(
        listen=listen,
        http=http,
        etcd=etcd,
        prefix=a.prefix.rstrip("/"),
        replica_id=replica_id,
        session_ttl=a.session_ttl,
        replica_ttl=a.replica_ttl,
        agent_ttl=a.agent_ttl,
        directive_timeout=a.directive_timeout,
        agent_liveness_timeout=a.agent_liveness_timeout,
        co_residency=a.co_residency,
        prefetch=a.prefetch,
        policy=Policy(a.policy),
        max_hold=a.max_hold,
        operator_token_file=a.operator_token_file,
        tls=server_tls,
        etcd_tls=etcd_tls,
        identity=IdentityRules(
            JobSource(a.tls_job_identity),
            a.tls_operator_ou.strip(),
            RESERVED_NAMES | {n.strip() for n in a.tls_reserved_names.split(",") if n.strip()},
        ),
        insecure=a.insecure,
        limits=_limits(p, a),
        compat_hold_ttl=a.compat_hold_ttl,
        start_timeout=a.start_timeout,
        etcd_timeout=a.etcd_timeout,
        etcd_probe=etcd_probe,
        dashboard=dashboard,
        connections=_connection_limits(p, a),
    )


# The gRPC port's connections (tls.py): flag, ConnectionLimits field, type, what it means.
_CONNECTION_OPTIONS: tuple[tuple[str, str, type, str], ...] = (
    (
        "max-pending-handshakes",
        "max_pending",
        int,
        "connections whose TLS handshake is not done yet, at most; past it the oldest that "
        "sent nothing is dropped, or accepting pauses (the kernel backlog holds the rest)",
    ),
    (
        "max-pending-per-address",
        "max_pending_per_address",
        int,
        "of those, from one source address (IPv6: a /64); more are closed at once",
    ),
    (
        "hello-timeout",
        "hello_timeout",
        float,
        "seconds a new connection has to send its first bytes (the TLS ClientHello)",
    ),
    ("handshake-timeout", "handshake_timeout", float, "seconds from accept to a done handshake"),
    (
        "max-connections-per-identity",
        "max_per_identity",
        int,
        "connections one client certificate's identity (a job, node, operator) may keep to a "
        "replica; the next one is sent GOAWAY and closed",
    ),
    (
        "idle-connection-timeout",
        "idle_timeout",
        float,
        "seconds a connection with no open call and no traffic stays open (0: forever); an "
        "open stream keeps it",
    ),
)


def _add_connection_limits(p: argparse.ArgumentParser) -> None:
    defaults = ConnectionLimits()
    group = p.add_argument_group("connections", "limits on the gRPC port's connections (TLS)")
    for flag, name, kind, text in _CONNECTION_OPTIONS:
        group.add_argument(
            "--" + flag,
            dest="conn_" + name,
            type=kind,
            default=_env(
                flag.upper().replace("-", "_"), str(getattr(defaults, name)), legacy_name=False
            ),
            help=text,
        )


def _connection_limits(p: argparse.ArgumentParser, a: argparse.Namespace) -> ConnectionLimits:
    try:
        return ConnectionLimits(
            **{name: getattr(a, "conn_" + name) for _, name, _, _ in _CONNECTION_OPTIONS}
        )
    except ValueError as exc:
        message = str(exc)  # names a field: say which flag
        for flag, name, _, _ in sorted(_CONNECTION_OPTIONS, key=lambda o: -len(o[1])):
            message = message.replace(name, "--" + flag)
        p.error(message)


# Quotas (limits.py): what one flag means, its default, and its Limits field.
_LIMIT_OPTIONS: tuple[tuple[str, type, str], ...] = (
    ("max_groups", int, "groups the deployment keeps at most"),
    (
        "max_groups_per_job",
        int,
        "groups one job's Acquires may create that still exist (until the idle clean-up "
        "removes them); operators' pinned groups count in --max-groups only",
    ),
    ("max_sessions", int, "sessions open at once, over every job"),
    ("max_sessions_per_job", int, "sessions one job may have open at once"),
    ("max_entries_per_session", int, "queue entries and holds of one session, over all groups"),
    ("max_id_length", int, "longest job, group or node id accepted (at most 253)"),
    ("max_members", int, "nodes an operator may pin to one group"),
    ("max_message_bytes", int, "largest gRPC message accepted, in bytes"),
    ("idle_group_ttl", float, "seconds a group stays idle before it is removed; 0 = never"),
    ("cleanup_batch", int, "groups one clean-up pass removes at most"),
    (
        "client_rate",
        float,
        "call tokens a second each client may spend (a client: a certificate's identity, "
        "over all its connections; a connection in plaintext; a call costs 1-10, 10 more "
        "when refused); 0 = no admission control",
    ),
    ("client_burst", int, "tokens a client may spend at once"),
    ("client_max_waiting", int, "calls of one client that may wait for tokens"),
    ("client_max_wait", float, "seconds a call may wait for tokens before it is refused"),
)


def _add_limits(p: argparse.ArgumentParser) -> None:
    defaults = Limits()
    for name, kind, text in _LIMIT_OPTIONS:
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=_env(name.upper(), str(getattr(defaults, name))),
            help=text,
        )


def _limits(p: argparse.ArgumentParser, a: argparse.Namespace) -> Limits:
    try:
        return Limits(**{name: getattr(a, name) for name, _, _ in _LIMIT_OPTIONS})
    except ValueError as exc:
        p.error(str(exc))
