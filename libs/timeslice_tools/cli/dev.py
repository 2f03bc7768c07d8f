"""``timeslice dev cluster``: etcd, orchestrators and agents on this machine, in the foreground.

Prints ``ready <targets>`` once the cluster serves, then the exports a job needs, and runs
until SIGINT/SIGTERM, warning about any process that exits on its own.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from timeslice.cli.base import (
    OPERATOR_TOKEN_FILE_ENV,
    Commands,
    Interrupted,
    Parser,
    count,
    out,
    positive_float,
)
from timeslice.errors import InvalidArgument, Unavailable
from timeslice.targets import TARGET_ENV, parse_address
from timeslice_tools.dev.cluster import BACKENDS, ClusterError, LocalCluster
from timeslice_tools.dev.etcd import EtcdError

__all__ = ["cmd_dev_cluster", "parse_etcd", "register"]


def register(commands: Commands) -> None:
    """Add ``dev`` and its subcommands."""
    dev = commands.add("dev", cmd_dev, help="local development tools")
    dev_sub = dev.add_subparsers(dest="dev_command", metavar="DEV_COMMAND", parser_class=Parser)
    dev_sub.required = True
    cluster = dev_sub.add_parser(
        "cluster",
        help="run etcd, orchestrators and agents locally in the foreground",
        description="Run a local cluster until SIGINT/SIGTERM. Prints 'ready <targets>' once it "
        "serves.",
    )
    cluster.add_argument("--replicas", type=count(1), default=1, help="orchestrator replicas")
    cluster.add_argument("--agents", type=count(0), default=1, help="node agents")
    cluster.add_argument("--backend", choices=BACKENDS, default="sim")
    cluster.add_argument("--etcd", help="use this etcd (HOST:PORT[,...]) instead of starting one")
    cluster.add_argument("--prefix", help="etcd key prefix (default /timeslice/dev-<random>)")
    cluster.add_argument("--session-ttl", type=positive_float, default=10.0)
    cluster.add_argument(
        "--tls",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="make a throw-away CA and certificates: mutual TLS on every hop, etcd auth",
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
    assert args.dev_command == "cluster", args.dev_command
    return cmd_dev_cluster(args)


def cmd_dev_cluster(args: argparse.Namespace) -> int:
    """``timeslice dev cluster``."""
    etcd = parse_etcd(args.etcd) if args.etcd is not None else None
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
            tls=args.tls,
        )
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        try:
            cluster.start()
        except (ClusterError, EtcdError) as exc:
            raise Unavailable(f"the local cluster did not start: {exc}") from None
        out(f"ready {cluster.target}")
        out(f"export {TARGET_ENV}={cluster.target}")
        out(f"export {OPERATOR_TOKEN_FILE_ENV}={cluster.operator_token_file}")
        for name, value in cluster.client_env.items():
            out(f"export {name}={value}")
        for node, path in cluster.agent_sockets.items():
            out(f"agent {node}: export TIMESLICE_AGENT_SOCKET={path}")
        out(f"etcd {cluster.etcd_endpoint} prefix {cluster.prefix}")
        kept = "" if args.base_dir is not None else " (removed on exit; --base-dir keeps them)"
        out(f"logs {cluster.log_dir}{kept}")
        pids = " ".join(f"{name}={p.pid}" for name, p in cluster.processes.items())
        out(f"pids {pids}")
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
    out("stopped")
    return 0
