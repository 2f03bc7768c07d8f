"""``timeslice dev cluster``: etcd, orchestrators and agents on this machine, in the foreground.

Prints ``ready <targets>`` once the cluster serves, then the exports clients need (with TLS:
the CA, a certificate per job of ``--jobs``, and the operator's for operator commands), and
runs until SIGINT/SIGTERM, warning about any process that exits on its own. TLS on every hop
unless ``--no-tls``.

``timeslice dev certs --out DIR``: the CA and certificates of a deployment (the Secrets of
the Compose and Kubernetes deployments), made by :class:`timeslice_tools.dev.certs.Pki`.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from timeslice.cli.base import (
    OPERATOR_TOKEN_FILE_ENV,
    Commands,
    Interrupted,
    Parser,
    add_json_option,
    count,
    out,
    positive_float,
    print_json,
)
from timeslice.errors import InvalidArgument, Unavailable
from timeslice.targets import TARGET_ENV, parse_address
from timeslice.tls import CA_ENV, CERT_ENV, KEY_ENV
from timeslice_tools.dev.certs import DEFAULT_DAYS, RESERVED_NAMES, Pki
from timeslice_tools.dev.cluster import BACKENDS, ClusterError, LocalCluster
from timeslice_tools.dev.etcd import EtcdError

__all__ = ["cmd_dev_certs", "cmd_dev_cluster", "parse_etcd", "register"]

# Node and job names become file names (node-<name>.crt).
_FILE_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# The jobs `dev cluster` prints certificates for unless --jobs names others.
DEV_JOBS = ("job-a", "job-b")
JOB_ID_ENV = "TIMESLICE_JOB_ID"


def register(commands: Commands) -> None:
    """Add ``dev`` and its subcommands."""
    dev = commands.add(
        "dev",
        cmd_dev,
        help="local development tools",
        description="Development tools: a whole cluster on this machine (dev cluster), and "
        "the certificates of a deployment (dev certs).",
        epilog="examples:\n"
        "  timeslice dev cluster --agents 2 --backend sim\n"
        "  timeslice dev certs --out ./certs --nodes node-0 --jobs job-a",
    )
    dev_sub = dev.add_subparsers(dest="dev_command", metavar="DEV_COMMAND", parser_class=Parser)
    dev_sub.required = True
    cluster = dev_sub.add_parser(
        "cluster",
        help="run etcd, orchestrators and agents locally in the foreground",
        description="Run a local cluster until SIGINT/SIGTERM. Prints 'ready <targets>' once it "
        "serves, then the exports a client needs (with --json: one JSON object with all of it, "
        'then {"event": "stopped"} on the way out).',
        epilog="examples:\n"
        "  timeslice dev cluster --replicas 2 --agents 2\n"
        "  timeslice dev cluster --no-tls --backend freeze --base-dir /tmp/ts\n"
        "  timeslice dev cluster --json | head -n1 | jq -r .target",
    )
    cluster.add_argument("--replicas", type=count(1), default=1, help="orchestrator replicas")
    cluster.add_argument("--agents", type=count(0), default=1, help="node agents")
    cluster.add_argument("--backend", choices=BACKENDS, default="sim")
    cluster.add_argument("--etcd", help="use this etcd (HOST:PORT[,...]) instead of starting one")
    cluster.add_argument(
        "--etcd-members",
        type=count(1),
        default=1,
        help="members of the etcd started here (3: a highly available cluster on loopback; "
        "every replica is given all of them)",
    )
    cluster.add_argument("--prefix", help="etcd key prefix (default /timeslice/dev-<random>)")
    cluster.add_argument("--session-ttl", type=positive_float, default=10.0)
    cluster.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mutual TLS on every hop and etcd auth, with a throw-away CA (the default); "
        "--no-tls runs every hop in plaintext",
    )
    cluster.add_argument(
        "--certs",
        type=Path,
        metavar="DIR",
        help="use the CA and certificates in DIR (made there if DIR has no ca.crt; see "
        "'timeslice dev certs') instead of a throw-away CA; its etcd certificates must be "
        "those of --etcd",
    )
    cluster.add_argument(
        "--jobs",
        nargs="*",
        default=list(DEV_JOBS),
        metavar="JOB",
        help="jobs to print a certificate's exports for (each may act as itself only; the "
        f"operator's certificate is for operator commands); default {' '.join(DEV_JOBS)}",
    )
    certs = dev_sub.add_parser(
        "certs",
        help="make a CA and the certificates of a deployment (Compose, Kubernetes Secrets)",
        description="Write a new CA, etcd's own CA and the certificates of every component to "
        "--out: orchestrator, etcd (server, replicas' client, root; from the etcd CA), an "
        "operator, and one per node and job given (never named root or timeslice: etcd's "
        "users). Keep ca.key and etcd-ca.key away from the services.",
        epilog="examples:\n"
        "  timeslice dev certs --out ./certs --nodes node-0 node-1 --jobs job-a job-b\n"
        "  timeslice dev certs --out ./certs --hosts orchestrator.ns.svc --force\n"
        "  timeslice dev certs --out ./certs --split-etcd-ca --json",
    )
    certs.add_argument("--out", type=Path, required=True, metavar="DIR", help="where to write")
    certs.add_argument("--nodes", nargs="*", default=[], metavar="NODE", help="agents' node names")
    certs.add_argument("--jobs", nargs="*", default=[], metavar="JOB", help="jobs' ids")
    certs.add_argument(
        "--hosts",
        nargs="*",
        default=[],
        metavar="HOST",
        help="DNS names or IP addresses the orchestrator and etcd answer on, besides "
        "localhost (Service names, say)",
    )
    certs.add_argument("--days", type=count(1), default=DEFAULT_DAYS, help="validity")
    add_json_option(certs)
    add_json_option(cluster)
    certs.add_argument(
        "--force", action="store_true", help="replace a CA already in --out (a new CA)"
    )
    certs.add_argument(
        "--split-etcd-ca",
        action="store_true",
        help="migrate a directory made with one CA for everything: add its own etcd CA "
        "(etcd-ca.crt) and re-issue etcd-server, etcd-client and etcd-root from it; the CA "
        "and every other certificate stay (docs/security.md)",
    )
    cluster.add_argument(
        "--base-dir",
        type=Path,
        help="directory for logs, sockets and state (default: a temporary one, removed on exit)",
    )


def parse_etcd(text: str) -> str:
    """``--etcd`` as the services take it: ``HOST:PORT[,HOST:PORT]`` (``http://`` accepted)."""
    endpoints: list[str] = []
    for part in (s.strip() for s in text.split(",")):
        if not part:
            continue
        for scheme in ("http://", "https://"):
            part = part.removeprefix(scheme)
        endpoints.append(str(parse_address(part.rstrip("/"), what="etcd endpoint")))
    if not endpoints:
        raise InvalidArgument(f"etcd {text!r} names no endpoint")
    return ",".join(endpoints)


def cmd_dev(args: argparse.Namespace) -> int:
    """``timeslice dev DEV_COMMAND``."""
    if args.dev_command == "certs":
        return cmd_dev_certs(args)
    assert args.dev_command == "cluster", args.dev_command
    return cmd_dev_cluster(args)


def _cert_exports(env: dict[str, str]) -> str:
    return f"{CERT_ENV}={env[CERT_ENV]} {KEY_ENV}={env[KEY_ENV]}"


def cmd_dev_certs(args: argparse.Namespace) -> int:
    """``timeslice dev certs --out DIR``: a CA and every component's certificate."""
    out_dir: Path = args.out
    if args.split_etcd_ca:
        if args.force or args.nodes or args.jobs or args.hosts:
            raise InvalidArgument("--split-etcd-ca takes only --out (and --days)")
        if not (out_dir / "ca.crt").exists():
            raise InvalidArgument(f"{out_dir} holds no CA (ca.crt) to migrate")
        pki = Pki(out_dir)
        if not pki.split_etcd_ca(days=args.days):
            raise InvalidArgument(f"{out_dir} already has its own etcd CA ({pki.etcd_ca.name})")
        written = (pki.etcd_ca, pki.etcd_server.cert, pki.etcd_client.cert, pki.etcd_root.cert)
        _paths(args, written)
        return 0
    if (out_dir / "ca.crt").exists() and not args.force:
        raise InvalidArgument(
            f"{out_dir} already holds a CA (ca.crt): certificates signed by a new one would "
            "not be trusted by what uses the old one; pass --force to replace it"
        )
    _check_names([*args.nodes, *args.jobs])
    pki = Pki.create(out_dir, nodes=args.nodes, jobs=args.jobs, hosts=args.hosts, days=args.days)
    _paths(
        args,
        [
            path
            for path in sorted(pki.directory.iterdir())
            if path.suffix in (".crt", ".key") and not path.name.startswith(".")
        ],
    )
    return 0


def _paths(args: argparse.Namespace, paths: Sequence[Path]) -> None:
    """The files ``dev certs`` wrote: one per line, or a JSON list with ``--json``."""
    if args.json:
        print_json([str(path) for path in paths])
    else:
        for path in paths:
            out(str(path))


def _check_names(names: list[str]) -> None:
    """Refuse node and job names that cannot name a certificate's files, or name an etcd user."""
    for name in names:
        if not _FILE_SAFE.fullmatch(name):
            raise InvalidArgument(f"{name!r} cannot be part of a file name")
        if name in RESERVED_NAMES:
            raise InvalidArgument(
                f"{name!r} is an etcd user (reserved: {', '.join(sorted(RESERVED_NAMES))}): "
                "a job or node certificate named so could act as that user in etcd; choose "
                "another name"
            )


def cmd_dev_cluster(args: argparse.Namespace) -> int:
    """``timeslice dev cluster``."""
    _check_names(args.jobs)
    etcd = parse_etcd(args.etcd) if args.etcd is not None else None
    if etcd is not None and args.etcd_members > 1:
        raise InvalidArgument("--etcd-members starts an etcd here: it does not go with --etcd")
    shutting_down = False

    def on_signal(signum: int, frame: FrameType | None) -> None:
        nonlocal shutting_down
        # The first signal unwinds whatever we are doing (starting or waiting); later ones
        # must not interrupt the orderly stop that follows.
        if not shutting_down:
            shutting_down = True
            raise Interrupted

    try:
        cluster = LocalCluster(
            replicas=args.replicas,
            agents=args.agents,
            backend=args.backend,
            etcd_endpoint=etcd,
            prefix=args.prefix,
            session_ttl=args.session_ttl,
            base_dir=args.base_dir,
            tls=Pki(args.certs) if args.certs is not None else args.tls,
            etcd_members=args.etcd_members,
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for sig in previous:
            signal.signal(sig, on_signal)
        try:
            cluster.start()
        except (ClusterError, EtcdError) as exc:
            raise Unavailable(f"the local cluster did not start: {exc}") from None
        if args.json:
            out(json.dumps(_ready_document(cluster, args.jobs)))
        else:
            _print_ready(cluster, args)
            out("stop with Ctrl-C (SIGINT) or SIGTERM")
        reported: set[str] = set()
        while True:
            time.sleep(0.5)
            for name, code in cluster.exited().items():
                if name not in reported:
                    reported.add(name)
                    print(
                        f"warning: {name} exited with status {code}; last log lines:\n"
                        f"{cluster.log_tail(name, 20)}",
                        file=sys.stderr,
                        flush=True,
                    )
    except Interrupted:
        pass
    finally:
        shutting_down = True
        cluster.stop()
        # Called in-process (tests, embedding tools), the caller's handlers come back: a
        # leaked one would turn the caller's next Ctrl-C into a no-op.
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.json:
        out(json.dumps({"event": "stopped"}))
    else:
        out("stopped")
    return 0


def _print_ready(cluster: LocalCluster, args: argparse.Namespace) -> None:
    """What a running ``dev cluster`` prints for people: the targets and the exports."""
    out(f"ready {cluster.target}")
    for replica, url in cluster.dashboard_urls.items():
        out(f"dashboard {replica}: {url}")
    out(f"export {TARGET_ENV}={cluster.target}")
    out(f"export {OPERATOR_TOKEN_FILE_ENV}={cluster.operator_token_file}")
    if cluster.pki is None:
        for name, value in cluster.client_env.items():
            out(f"export {name}={value}")
    else:
        # The CA for everyone; a certificate per job, and the operator's for operator
        # commands only (it may act as any job, and all its clients share one bucket).
        out(f"export {CA_ENV}={cluster.pki.ca}")
        for job in args.jobs:
            out(f"job {job}: export {JOB_ID_ENV}={job} {_cert_exports(cluster.job_env(job))}")
        out(f"operator (groups, status, top, members): export "
            f"{_cert_exports(cluster.client_env)}")  # fmt: skip
    for node, path in cluster.agent_sockets.items():
        out(f"agent {node}: export TIMESLICE_AGENT_SOCKET={path}")
    out(f"etcd {cluster.etcd_endpoint} prefix {cluster.prefix}")
    kept = "" if args.base_dir is not None else " (removed on exit; --base-dir keeps them)"
    out(f"logs {cluster.log_dir}{kept}")
    pids = " ".join(f"{name}={p.pid}" for name, p in cluster.processes.items())
    out(f"pids {pids}")


def _ready_document(cluster: LocalCluster, jobs: Sequence[str]) -> dict[str, object]:
    """What a running ``dev cluster --json`` prints, as one object on one line: the targets,
    the environment of a job and of the operator, the agents' sockets, etcd, logs, pids."""
    common = {TARGET_ENV: cluster.target, OPERATOR_TOKEN_FILE_ENV: str(cluster.operator_token_file)}
    if cluster.pki is not None:
        common[CA_ENV] = str(cluster.pki.ca)
    return {
        "event": "ready",
        "target": cluster.target,
        "dashboards": cluster.dashboard_urls,
        "tls": cluster.pki is not None,
        "env": {**common, **cluster.client_env},
        "jobs": {
            job: {**common, JOB_ID_ENV: job, **cluster.job_env(job)}
            for job in (jobs if cluster.pki is not None else [])
        },
        "agent_sockets": {node: str(path) for node, path in cluster.agent_sockets.items()},
        "etcd": cluster.etcd_endpoint,
        "prefix": cluster.prefix,
        "logs": str(cluster.log_dir),
        "pids": {name: p.pid for name, p in cluster.processes.items()},
    }
