"""Command-line and environment configuration of the agent.

Every option ``--some-name`` can also be given as the environment variable
``TIMESLICE_AGENT_SOME_NAME``; the command line wins. Values from the environment go through the
same parsing and validation as the command line, so a bad value fails the start with a clear
message either way.
"""

from __future__ import annotations

import argparse
import enum
import grp
import math
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from timeslice.argv import OneLineParser
from timeslice.errors import InvalidArgument
from timeslice.ids import validate_node
from timeslice.targets import parse_address
from timeslice.tls import TlsFiles
from timeslice.wire import DEFAULT_MAX_MESSAGE_BYTES

ENV_PREFIX = "TIMESLICE_AGENT_"
DEFAULT_WORKER_SOCKET = Path("/run/timeslice/agent.sock")
GB = 1_000_000_000


class BackendKind(enum.Enum):
    """The data-movement backends this agent can run: the one list of them.

    Each value names a module of :mod:`timeslice_agent.backends` that has a ``create``.
    """

    SIM = "sim"
    FREEZE = "freeze"
    CUDA = "cuda"
    APP = "app"


class CudaPath(enum.Enum):
    """How the ``cuda`` backend reaches the driver's checkpoint support."""

    AUTO = "auto"  # the driver API, else the cuda-checkpoint binary if it is on PATH
    DRIVER = "driver"  # cuCheckpointProcess* through cuda-bindings, in the agent process
    CLI = "cli"  # the cuda-checkpoint binary (--toggle --pid), one process per toggle


class Discovery(enum.Enum):
    """How the agent finds a job's processes besides explicit registrations."""

    AUTO = "auto"  # nvml where NVML works, else procfs; off for the sim and freeze backends
    NVML = "nvml"  # NVML's running compute processes, labelled by their environment
    PROCFS = "procfs"  # every process whose environment names a job (no NVML needed)
    OFF = "off"


@dataclass(frozen=True)
class Endpoint:
    """A ``HOST:PORT`` network address."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class SimSettings:
    """Parameters of the simulated (emulated) backend."""

    capacity_bytes: int
    bandwidth_bytes_per_s: float
    default_state_bytes: int
    time_scale: float
    faults: tuple[InjectedFault, ...] = ()


@dataclass(frozen=True)
class CudaSettings:
    """Parameters of the ``cuda`` backend."""

    path: CudaPath = CudaPath.AUTO
    lock_timeout_ms: int = 10_000
    binary: str = "cuda-checkpoint"


@dataclass(frozen=True)
class DeviceCheckSettings:
    """The NVML checks around real moves (see :mod:`timeslice_agent.devmem`)."""

    release_wait: float = 10.0
    app_residual_bytes: int = 2048 * 1024 * 1024


@dataclass(frozen=True)
class InjectedFault:
    """A failure the sim backend injects on purpose (tests, drills): KIND:ACTION[:JOB].

    ``kind`` is checkpoint or restore; ``action`` is fail (the backend reports an error) or
    hang (it never finishes, so the directive's deadline ends it); ``job`` limits it to one job.
    """

    kind: str
    action: str
    job: str = ""

    @classmethod
    def parse(cls, text: str) -> InjectedFault:
        parts = text.split(":")
        if (
            len(parts) not in (2, 3)
            or parts[0] not in ("checkpoint", "restore")
            or parts[1] not in ("fail", "hang")
        ):
            raise ValueError(f"--sim-fault {text!r}: expected checkpoint|restore:fail|hang[:JOB]")
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 else "")

    def applies(self, kind: str, job: str) -> bool:
        return self.kind == kind and (not self.job or self.job == job)


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent needs to start; built by :func:`parse_config`."""

    orchestrators: tuple[Endpoint, ...]
    node: str
    backend: BackendKind
    worker_socket: Path
    state_file: Path
    http: Endpoint | None
    sim: SimSettings
    hook_timeout: float
    log_level: str
    journal: Path | None = None
    host_reserve_gb: float = 2.0
    host_memory_gb: float = 0.0
    cuda: CudaSettings = CudaSettings()
    discovery: Discovery = Discovery.AUTO
    device_check: DeviceCheckSettings = DeviceCheckSettings()
    tls: TlsFiles | None = None
    """CA of the orchestrators' certificate, and this node's certificate and key (mutual TLS;
    the orchestrator takes the node name from it). None: plaintext, only with --insecure."""
    insecure: bool = False
    # The group that may connect to the worker socket (mode 0660); None: the agent's own group.
    worker_socket_group: int | None = None
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # The llm-d reference's snapshot agent API (docs/llmd-agent.md): TCP port, None = off.
    llmd_port: int | None = None
    llmd_host: str = "127.0.0.1"


def parse_endpoint(text: str, *, allow_port_zero: bool = False) -> Endpoint:
    """Parse ``HOST:PORT`` (IPv6 hosts in brackets); raise :class:`InvalidArgument` if malformed."""
    host, port = parse_address(text, port_zero=allow_port_zero)
    return Endpoint(host, port)


def _argtype(func: Callable[[str], object]) -> Callable[[str], object]:
    """Adapt a parser raising InvalidArgument/ValueError into one argparse reports cleanly."""

    def convert(text: str) -> object:
        try:
            return func(text)
        except (InvalidArgument, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(func, "__name__", "value")
    return convert


def _targets(text: str) -> tuple[Endpoint, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise InvalidArgument("--orchestrator needs at least one HOST:PORT")
    return tuple(parse_endpoint(p) for p in parts)


def _http_endpoint(text: str) -> Endpoint:
    return parse_endpoint(text, allow_port_zero=True)


def _number(minimum: float, *, inclusive: bool) -> Callable[[str], float]:
    def convert(text: str) -> float:
        value = float(text)
        if math.isnan(value) or math.isinf(value):
            raise InvalidArgument(f"{text!r} is not a finite number")
        if value < minimum or (not inclusive and value == minimum):
            bound = ">=" if inclusive else ">"
            raise InvalidArgument(f"{text!r} must be {bound} {minimum:g}")
        return value

    convert.__name__ = "number"
    return convert


def _group(text: str) -> int:
    """A group name or a numeric gid; the name must exist on this machine."""
    value = text.strip()
    if value.isdigit():
        return int(value)
    try:
        return grp.getgrnam(value).gr_gid
    except KeyError:
        raise InvalidArgument(f"--worker-socket-group {text!r}: no such group") from None


def _backend(text: str) -> BackendKind:
    try:
        return BackendKind(text.strip().lower())
    except ValueError:
        choices = ", ".join(k.value for k in BackendKind)
        raise InvalidArgument(f"backend {text!r} is not one of {choices}") from None


def _choice(kind: type[enum.Enum], option: str) -> Callable[[str], enum.Enum]:
    def convert(text: str) -> enum.Enum:
        try:
            return kind(text.strip().lower())
        except ValueError:
            choices = ", ".join(str(k.value) for k in kind)
            raise InvalidArgument(f"{option} {text!r} is not one of {choices}") from None

    convert.__name__ = option.lstrip("-")
    return convert


def _env_name(option: str) -> str:
    return ENV_PREFIX + option.lstrip("-").replace("-", "_").upper()


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The argparse parser; defaults come from ``environ`` where set."""
    parser = OneLineParser(
        prog="timeslice agent",
        description="timeslice snapshot agent (one per node). Every option may also be set "
        f"with the environment variable {ENV_PREFIX}<OPTION_NAME>.",
    )

    def add(option: str, default: str | None, help_text: str, **kwargs: object) -> None:
        env = _env_name(option)
        parser.add_argument(
            option,
            default=environ.get(env, default),
            help=f"{help_text} [env {env}]",
            **kwargs,  # type: ignore[arg-type]
        )

    add(
        "--orchestrator",
        None,
        "orchestrator targets HOST:PORT[,HOST:PORT...]; tried in turn on failure",
        type=_argtype(_targets),
        metavar="TARGETS",
    )
    add("--node", None, "node name (default: the hostname)", metavar="NAME")
    add(
        "--backend",
        "sim",
        f"{' | '.join(k.value for k in BackendKind)} (default sim: an emulation that moves "
        "nothing)",
        type=_argtype(_backend),
    )
    add(
        "--cuda-path",
        "auto",
        "cuda: driver (checkpoint API in-process) | cli (cuda-checkpoint binary) | auto",
        type=_argtype(_choice(CudaPath, "--cuda-path")),
    )
    add(
        "--cuda-lock-timeout-ms",
        "10000",
        "cuda: how long a lock waits for a process's in-flight CUDA work, in ms",
        type=_argtype(_number(1, inclusive=True)),
    )
    add(
        "--cuda-checkpoint-bin",
        "cuda-checkpoint",
        "cuda: the cuda-checkpoint binary for the cli path",
        metavar="PATH",
    )
    add(
        "--discover",
        "auto",
        "find job processes by TIMESLICE_JOB_ID/TIMESLICE_GROUP in their environment: "
        "nvml | procfs | off | auto (nvml, else procfs, for backends that free device "
        "memory, cuda and app; off otherwise)",
        type=_argtype(_choice(Discovery, "--discover")),
    )
    add(
        "--release-wait",
        "10",
        "cuda/app: seconds a checkpoint waits for NVML to show the job's memory freed",
        type=_argtype(_number(0, inclusive=True)),
    )
    add(
        "--app-residual-mib",
        "2048",
        "app: device memory a process may keep after its release (CUDA context), in MiB",
        type=_argtype(_number(0, inclusive=True)),
    )
    add(
        "--worker-socket",
        str(DEFAULT_WORKER_SOCKET),
        "unix socket for the WorkerLink service",
        metavar="PATH",
    )
    add(
        "--worker-socket-group",
        None,
        "group (name or gid) whose processes may register workers: the socket is created "
        "with mode 0660 and this group (default: the agent's own group)",
        type=_argtype(_group),
        metavar="GROUP",
    )
    add(
        "--state-file",
        None,
        "durable JSON state (default: agent-<node>.json next to the socket)",
        metavar="PATH",
    )
    add(
        "--http",
        None,
        "HOST:PORT for /healthz, /readyz and /metrics (port 0 picks one; default: off)",
        type=_argtype(_http_endpoint),
    )
    add(
        "--sim-capacity-gb",
        "80",
        "sim: device memory per node in GB",
        type=_argtype(_number(0, inclusive=False)),
    )
    add(
        "--sim-bandwidth-gbps",
        "50",
        "sim: host<->device bandwidth per direction in GB/s",
        type=_argtype(_number(0, inclusive=False)),
    )
    add(
        "--sim-state-gb",
        "40",
        "sim: device state of a job whose workers registered state_bytes=0, in GB",
        type=_argtype(_number(0, inclusive=True)),
    )
    add(
        "--sim-time-scale",
        "1.0",
        "sim: factor on modelled transfer time (0 = instantaneous)",
        type=_argtype(_number(0, inclusive=True)),
    )
    add(
        "--hook-timeout",
        "60",
        "seconds to wait for a worker's app callback",
        type=_argtype(_number(0, inclusive=False)),
    )
    add("--log-level", "INFO", "logging level", metavar="LEVEL")
    parser.add_argument(
        "--sim-fault",
        action="append",
        default=[],
        metavar="KIND:ACTION[:JOB]",
        help="sim: inject a failure (checkpoint|restore : fail|hang [: job]); repeatable",
    )
    add(
        "--host-reserve-gb",
        "2",
        "host memory kept free: a checkpoint that would eat into it is refused, in GB",
        type=_argtype(_number(0, inclusive=True)),
    )
    add(
        "--host-memory-gb",
        "0",
        "model a host of this size instead of reading MemAvailable (sim, tests), in GB",
        type=_argtype(_number(0, inclusive=True)),
    )
    add(
        "--journal",
        "",
        "append one JSON line per executed directive to this file (histories, audits)",
        metavar="PATH",
    )
    add("--tls-ca", None, "CA of the orchestrators' server certificates (PEM)", metavar="PATH")
    add(
        "--tls-cert",
        None,
        "this node's client certificate (PEM; reloaded on change)",
        metavar="PATH",
    )
    add("--tls-key", None, "its private key (PEM)", metavar="PATH")
    parser.add_argument(
        "--insecure",
        action="store_true",
        default=environ.get(_env_name("--insecure"), "").strip().lower()
        in ("1", "true", "yes", "on"),
        help="talk to the orchestrators in plaintext, unauthenticated (development only) "
        f"[env {_env_name('--insecure')}]",
    )
    add(
        "--max-message-bytes",
        str(DEFAULT_MAX_MESSAGE_BYTES),
        "largest gRPC message the worker socket accepts, in bytes (larger: RESOURCE_EXHAUSTED)",
        type=_argtype(_number(1, inclusive=True)),
    )
    add(
        "--llmd-port",
        None,
        "TCP port for the llm-d reference's snapshot_agent.v1alpha1 API and grpc.health.v1 "
        "(docs/llmd-agent.md; 0 picks one; default: off)",
        type=_argtype(_port),
        metavar="PORT",
    )
    add(
        "--llmd-host",
        "127.0.0.1",
        "address the llm-d API listens on (workloads register only over loopback)",
        metavar="HOST",
    )
    return parser


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise InvalidArgument(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"port must be 0 to 65535, got {port}")
    return port


def _faults(parser: argparse.ArgumentParser, texts: list[str]) -> list[InjectedFault]:
    try:
        return [InjectedFault.parse(t) for t in texts]
    except ValueError as exc:
        parser.error(str(exc))


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> AgentConfig:
    """Parse and validate the options; exits with status 2 and a message on bad input."""
    env = os.environ if environ is None else environ
    parser = build_parser(env)
    ns = parser.parse_args(argv)
    if ns.orchestrator is None:
        parser.error(f"--orchestrator (or {_env_name('--orchestrator')}) is required")
    node_text = ns.node if ns.node else socket.gethostname()
    try:
        node = validate_node(node_text)
    except InvalidArgument as exc:
        parser.error(str(exc))
    level = str(ns.log_level).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        parser.error(f"--log-level {ns.log_level!r} is not a logging level")
    worker_socket = Path(ns.worker_socket)
    state_file = (
        Path(ns.state_file) if ns.state_file else worker_socket.parent / f"agent-{node}.json"
    )
    sim = SimSettings(
        capacity_bytes=int(ns.sim_capacity_gb * GB),
        bandwidth_bytes_per_s=ns.sim_bandwidth_gbps * GB,
        default_state_bytes=int(ns.sim_state_gb * GB),
        time_scale=ns.sim_time_scale,
        faults=tuple(_faults(parser, ns.sim_fault)),
    )
    tls: TlsFiles | None = None
    if ns.tls_ca or ns.tls_cert or ns.tls_key:
        if not (ns.tls_ca and ns.tls_cert and ns.tls_key):
            parser.error("--tls-ca, --tls-cert and --tls-key go together (mutual TLS)")
        tls = TlsFiles(ns.tls_ca, ns.tls_cert, ns.tls_key)
    elif not ns.insecure:
        parser.error(
            "no TLS: give --tls-ca, --tls-cert and --tls-key, or --insecure to talk to the "
            "orchestrators in plaintext"
        )
    return AgentConfig(
        orchestrators=ns.orchestrator,
        node=node,
        backend=ns.backend,
        worker_socket=worker_socket,
        state_file=state_file,
        http=ns.http,
        sim=sim,
        hook_timeout=ns.hook_timeout,
        log_level=level,
        journal=Path(ns.journal) if ns.journal else None,
        host_reserve_gb=ns.host_reserve_gb,
        host_memory_gb=ns.host_memory_gb,
        cuda=CudaSettings(
            path=ns.cuda_path,
            lock_timeout_ms=int(ns.cuda_lock_timeout_ms),
            binary=ns.cuda_checkpoint_bin,
        ),
        discovery=ns.discover,
        device_check=DeviceCheckSettings(
            release_wait=ns.release_wait,
            app_residual_bytes=int(ns.app_residual_mib * 1024 * 1024),
        ),
        tls=tls,
        insecure=tls is None,
        worker_socket_group=ns.worker_socket_group,
        max_message_bytes=int(ns.max_message_bytes),
        llmd_port=ns.llmd_port,
        llmd_host=str(ns.llmd_host),
    )
