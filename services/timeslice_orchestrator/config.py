"""Settings of one orchestrator replica, from flags or environment variables.

Every option ``--some-name`` can also be given as ``TIMESLICE_ORCHESTRATOR_SOME_NAME`` (the
agent's options likewise as ``TIMESLICE_AGENT_SOME_NAME``); the command line wins.
"""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from timeslice._options import OptionGroup, ServiceOptions
from timeslice.targets import HostPort, parse_address
from timeslice.tls import TlsFiles
from timeslice_orchestrator.dashboard import DashboardConfig
from timeslice_orchestrator.identity import RESERVED_NAMES, IdentityRules, JobSource
from timeslice_orchestrator.limits import Limits
from timeslice_orchestrator.policy import Policy
from timeslice_orchestrator.store.etcd import MemberProbe, parse_endpoints
from timeslice_orchestrator.tls import ConnectionLimits


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
    long it has to answer (store/etcd/members.py)."""
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    """Limits of the dashboard on the HTTP port (docs/dashboard.md)."""
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    """What one peer may hold on the gRPC port with TLS: pending handshakes, deadlines,
    connections per identity, idle connections (tls.py, docs/security.md)."""
    compat_hold_ttl: int = 10
    """TTL of the implicit sessions of v1alpha1 (llm-d) clients: how long a hold outlives
    its client's connection at most (docs/migrating-from-llm-d.md)."""
    log_level: str = "INFO"
    """The least severe log records written (``--log-level``)."""
    strict_groups: bool = False
    """Refuse (NOT_FOUND) a v1 Acquire of a group that is not known, instead of creating it
    and granting it with a warning (``--strict-groups``, docs/groups.md)."""


ENV_PREFIX = "TIMESLICE_ORCHESTRATOR_"
# Before one naming scheme (TIMESLICE_<SERVICE>_<OPTION>, as the agent's), the orchestrator
# read TIMESLICE_<OPTION>; those names still work, with a warning, so no deployment breaks.
_LEGACY_PREFIX = "TIMESLICE_"


def build_parser(environ: Mapping[str, str] | None = None) -> ServiceOptions:
    """The orchestrator's options, in one group per concern; defaults from ``environ``."""
    o = ServiceOptions(
        "timeslice orchestrator",
        "One orchestrator replica of timeslice (run several on one etcd).",
        ENV_PREFIX,
        os.environ if environ is None else environ,
        legacy_prefix=_LEGACY_PREFIX,
    )
    # Options older than the one naming scheme also read TIMESLICE_<OPTION> (legacy_env).
    listen = o.group("listen", "where this replica serves")
    listen.option("--listen", "0.0.0.0:50051", "gRPC HOST:PORT", legacy_env=True)
    listen.option(
        "--http",
        "0.0.0.0:8080",
        "health, metrics and dashboard HOST:PORT (plaintext, unauthenticated: bind it to a "
        "trusted network)",
        legacy_env=True,
    )
    listen.option(
        "--replica-id",
        "",
        "unique name of this replica (default: host-random)",
        legacy_env=True,
    )
    listen.log_level()

    etcd = o.group("etcd", "where the deployment's state lives (docs/operations.md)")
    etcd.option(
        "--etcd", "127.0.0.1:2379", "comma-separated etcd HOST:PORT endpoints", legacy_env=True
    )
    etcd.option(
        "--prefix", "/timeslice/default", "etcd key prefix of this deployment", legacy_env=True
    )
    etcd.option(
        "--start-timeout", "30", "how long start-up waits for etcd before giving up", type=float
    )
    etcd.option("--etcd-timeout", "5", "deadline of each etcd call", type=float)
    etcd.option(
        "--etcd-probe-after",
        "0.5",
        "an etcd call unanswered this long has its member asked for its status; a member "
        "that does not answer, or has lost its leader, is left and its calls end at once "
        "(0: off, calls wait for their deadline)",
        type=float,
    )
    etcd.option(
        "--etcd-probe-timeout",
        "0.5",
        "how long an etcd member has to answer that probe",
        type=float,
    )

    timing = o.group("timing", "leases and deadlines")
    timing.option(
        "--session-ttl", "10", "default client session lease TTL", type=int, legacy_env=True
    )
    timing.option(
        "--replica-ttl",
        "5",
        "this replica's lease TTL: how fast others take over its groups",
        type=int,
        legacy_env=True,
    )
    timing.option(
        "--agent-ttl",
        "10",
        "how long a node stays in its groups after its agent's stream drops",
        type=int,
        legacy_env=True,
    )
    timing.option(
        "--directive-timeout",
        "30",
        "deadline of one checkpoint/restore directive on a node",
        type=float,
        legacy_env=True,
    )
    timing.option(
        "--agent-liveness-timeout",
        "4",
        "an agent silent this long (no heartbeat) is fenced out of its groups; 0 turns "
        "heartbeats off (then only a missed directive deadline fences a node)",
        type=float,
        legacy_env=True,
    )
    timing.option(
        "--compat-hold-ttl",
        "10",
        "v1alpha1 (llm-d) clients: a hold lapses at most this long after its client's "
        "connection closes",
        type=int,
    )

    scheduling = o.group("scheduling", "which waiter a group serves, and when")
    scheduling.option(
        "--policy",
        "fifo",
        "which waiter a group serves next",
        choices=[x.value for x in Policy],
        legacy_env=True,
    )
    scheduling.option(
        "--max-hold",
        "0",
        "how long a holder holds before it is asked (co-operatively) to yield when others "
        "wait; 0 = never",
        type=float,
        legacy_env=True,
    )
    scheduling.switch(
        "--co-residency",
        "keep an idle job's state on the devices while the next job fits next to it "
        "(needs honest state_bytes that include each job's peak working memory)",
        negatable=True,
        legacy_env=True,
    )
    scheduling.switch(
        "--prefetch",
        "restore the next waiter's state while the holder still runs, when it fits beside it "
        "(device capacity reported by the agents)",
        negatable=True,
        legacy_env=True,
    )
    scheduling.switch(
        "--strict-groups",
        "refuse (NOT_FOUND) an Acquire of a group that is not known: no agent has a worker "
        "registered in it, no nodes are pinned to it, no operator created it (a mistyped "
        "name); without it such a group is created and granted with a warning. The llm-d "
        "(v1alpha1) API always creates groups on first acquire (docs/groups.md)",
        negatable=True,
    )

    _add_quotas(o.group("limits", "quotas; past one a call is refused with RESOURCE_EXHAUSTED"),
                _LIMIT_OPTIONS)  # fmt: skip
    _add_quotas(
        o.group("admission", "token buckets per client, before any call reaches etcd"),
        _ADMISSION_OPTIONS,
    )
    _add_connection_limits(
        o.group("connections", "what one peer may hold on the gRPC port with TLS (tls.py)")
    )

    tls = o.group(
        "TLS and operators",
        "certificates are PEM files, reloaded when they change (new connections use them)",
    )
    for flag, what in (
        ("--tls-cert", "this replica's server certificate (chain)"),
        ("--tls-key", "its private key"),
        ("--tls-ca", "the CA that signs clients' and agents' certificates"),
        ("--etcd-ca", "the CA of etcd's server certificate (turns etcd TLS on)"),
        ("--etcd-cert", "our client certificate towards etcd (its CN: the user)"),
        ("--etcd-key", "its private key"),
    ):
        tls.option(flag, None, what, metavar="PATH")
    tls.option(
        "--tls-job-identity",
        "uri",
        "where a job's client certificate names its job: SAN URI timeslice://job/<id>, the "
        "first DNS SAN, or the subject CN",
        choices=[x.value for x in JobSource],
    )
    tls.option(
        "--tls-operator-ou",
        "",
        "make a client certificate with this subject OU an operator (besides SAN URI "
        "timeslice://operator); off unless given: whoever may issue a job certificate with "
        "that OU would otherwise issue an operator",
        metavar="OU",
    )
    tls.option(
        "--tls-reserved-names",
        "",
        "etcd users besides root and timeslice (always reserved): a client certificate whose "
        "CN, job or node is one of them is refused every call",
        metavar="NAME[,NAME]",
    )
    tls.option(
        "--operator-token-file",
        "",
        "file with the operator token: SetGroupMembers and the operator yield need it as "
        "gRPC metadata 'authorization: Bearer <token>', or an operator certificate",
        metavar="PATH",
        legacy_env=True,
    )
    tls.switch(
        "--insecure",
        "allow plaintext where no certificate is given (gRPC port, etcd): development only",
    )

    dashboard = o.group("dashboard", "the page on the HTTP port (docs/dashboard.md)")
    dashboard.option(
        "--dashboard-max-streams",
        "256",
        "dashboard event streams open at once; more get 503 (0: the page cannot stream)",
        type=int,
    )
    dashboard.option(
        "--dashboard-stuck-seconds",
        "10",
        "a dashboard stream whose write takes longer (its browser stopped reading) is dropped",
        type=float,
    )
    return o


def parse_args(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> OrchestratorConfig:
    """Parse and validate the options; exits with status 2 and one line on bad input."""
    p = build_parser(environ)
    a = p.parse(argv)
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
    for name in ("tls_cert", "tls_key", "tls_ca", "etcd_ca", "etcd_cert", "etcd_key"):
        setattr(a, name, getattr(a, name) or None)  # an empty variable gives no file
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
        strict_groups=a.strict_groups,
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
        log_level=a.log_level,
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


def _add_connection_limits(group: OptionGroup) -> None:
    defaults = ConnectionLimits()
    for flag, name, kind, text in _CONNECTION_OPTIONS:
        group.option(
            "--" + flag,
            str(getattr(defaults, name)),
            text,
            dest="conn_" + name,
            type=kind,
            metavar=flag.upper().replace("-", "_"),
        )


def _connection_limits(p: ServiceOptions, a: argparse.Namespace) -> ConnectionLimits:
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
    ("idle_group_ttl", float, "how long a group stays idle before it is removed; 0 = never"),
    ("cleanup_batch", int, "groups one clean-up pass removes at most"),
)
# Admission control (admission.py), also Limits fields.
_ADMISSION_OPTIONS: tuple[tuple[str, type, str], ...] = (
    (
        "client_rate",
        float,
        "call tokens a second each client may spend (a client: a certificate's identity, "
        "over all its connections; a connection in plaintext; a call costs 1-10, 10 more "
        "when refused); 0 = no admission control",
    ),
    ("client_burst", int, "tokens a client may spend at once"),
    ("client_max_waiting", int, "calls of one client that may wait for tokens"),
    ("client_max_wait", float, "how long a call may wait for tokens before it is refused"),
)


def _add_quotas(group: OptionGroup, options: tuple[tuple[str, type, str], ...]) -> None:
    defaults = Limits()
    for name, kind, text in options:
        flag = "--" + name.replace("_", "-")
        group.option(flag, str(getattr(defaults, name)), text, type=kind, legacy_env=True)


def _limits(p: ServiceOptions, a: argparse.Namespace) -> Limits:
    try:
        return Limits(
            **{name: getattr(a, name) for name, _, _ in _LIMIT_OPTIONS + _ADMISSION_OPTIONS}
        )
    except ValueError as exc:
        p.error(str(exc))
