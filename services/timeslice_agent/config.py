"""Command-line and environment configuration of the agent.

Every option ``--some-name`` can also be given as the environment variable
``TIMESLICE_AGENT_SOME_NAME``; the command line wins. Values from the environment go through the
same parsing and validation as the command line, so a bad value fails the start with a clear
message either way.
"""

from __future__ import annotations

import enum
import grp
import math
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from timeslice._options import EMULATION, ServiceOptions, argtype
from timeslice.agent_contract import BackendKind as BackendKind
from timeslice.errors import InvalidArgument
from timeslice.ids import validate_node
from timeslice.targets import parse_address
from timeslice.tls import TlsFiles
from timeslice.wire import DEFAULT_MAX_MESSAGE_BYTES

ENV_PREFIX = "TIMESLICE_AGENT_"
DEFAULT_WORKER_SOCKET = Path("/run/timeslice/agent.sock")
GB = 1_000_000_000


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


def build_parser(environ: Mapping[str, str]) -> ServiceOptions:
    """The agent's options, in one group per concern; defaults come from ``environ``."""
    o = ServiceOptions(
        "timeslice agent", "timeslice snapshot agent (one per node).", ENV_PREFIX, environ
    )
    node = o.group("node", "this node and the orchestrators it serves")
    node.option(
        "--orchestrator",
        None,
        "orchestrator targets HOST:PORT[,HOST:PORT...]; tried in turn on failure (required)",
        type=argtype(_targets),
        metavar="TARGETS",
    )
    node.option("--node", None, "node name (default: the hostname)", metavar="NAME")
    node.option(
        "--state-file",
        None,
        "durable JSON state (default: agent-<node>.json next to the socket)",
        metavar="PATH",
    )
    node.option(
        "--journal",
        "",
        "append one JSON line per executed directive to this file (histories, audits)",
        metavar="PATH",
    )
    node.log_level()

    listen = o.group("listen", "where this agent serves its node's workers and scrapers")
    listen.option(
        "--worker-socket",
        str(DEFAULT_WORKER_SOCKET),
        "unix socket for the WorkerLink service",
        metavar="PATH",
    )
    listen.option(
        "--worker-socket-group",
        None,
        "group (name or gid) whose processes may register workers: the socket is created "
        "with mode 0660 and this group (default: the agent's own group)",
        type=argtype(_group),
        metavar="GROUP",
    )
    listen.option(
        "--http",
        None,
        "HOST:PORT for /healthz, /readyz and /metrics (port 0 picks one; default: off)",
        type=argtype(_http_endpoint),
        metavar="HOST:PORT",
    )
    listen.option(
        "--llmd-port",
        None,
        "TCP port for the llm-d reference's snapshot_agent.v1alpha1 API and grpc.health.v1 "
        "(docs/llmd-agent.md; 0 picks one; default: off)",
        type=argtype(_port),
        metavar="PORT",
    )
    listen.option(
        "--llmd-host",
        "127.0.0.1",
        "address the llm-d API listens on (workloads register only over loopback)",
        metavar="HOST",
    )

    timing = o.group("timing and limits")
    timing.option(
        "--hook-timeout",
        "60",
        "how long to wait for a worker's app callback",
        type=argtype(_number(0, inclusive=False)),
        metavar="SECONDS",
    )
    timing.option(
        "--host-reserve-gb",
        "2",
        "host memory kept free: a checkpoint that would eat into it is refused",
        type=argtype(_number(0, inclusive=True)),
        metavar="GB",
    )
    timing.option(
        "--max-message-bytes",
        str(DEFAULT_MAX_MESSAGE_BYTES),
        "largest gRPC message the worker socket accepts (larger: RESOURCE_EXHAUSTED)",
        type=argtype(_number(1, inclusive=True)),
        metavar="BYTES",
    )

    tls = o.group("TLS", "PEM files; the certificate and key are reloaded when they change")
    tls.option("--tls-ca", None, "CA of the orchestrators' server certificates", metavar="PATH")
    tls.option("--tls-cert", None, "this node's client certificate", metavar="PATH")
    tls.option("--tls-key", None, "its private key", metavar="PATH")
    tls.switch(
        "--insecure",
        "talk to the orchestrators in plaintext, unauthenticated (development only)",
    )

    backend = o.group("backend", "how a job's device state moves (docs/gpu.md)")
    backend.option(
        "--backend",
        None,
        f"{' | '.join(k.value for k in BackendKind)} (required: sim only emulates, it "
        "moves nothing)",
        type=argtype(_backend),
        metavar="KIND",
    )
    backend.option(
        "--discover",
        "auto",
        "find job processes by TIMESLICE_JOB_ID/TIMESLICE_GROUP in their environment: "
        "nvml | procfs | off | auto (nvml, else procfs, for backends that free device "
        "memory, cuda and app; off otherwise)",
        type=argtype(_choice(Discovery, "--discover")),
        metavar="HOW",
    )
    backend.option(
        "--release-wait",
        "10",
        "cuda and app: how long a checkpoint waits for NVML to show the job's memory freed",
        type=argtype(_number(0, inclusive=True)),
        metavar="SECONDS",
    )

    cuda = o.group("cuda backend", "whole-process checkpoints through the driver")
    cuda.option(
        "--cuda-path",
        "auto",
        "driver (checkpoint API in-process) | cli (cuda-checkpoint binary) | auto",
        type=argtype(_choice(CudaPath, "--cuda-path")),
        metavar="HOW",
    )
    cuda.option(
        "--cuda-lock-timeout-ms",
        "10000",
        "how long a lock waits for a process's in-flight CUDA work",
        type=argtype(_number(1, inclusive=True)),
        metavar="MS",
    )
    cuda.option(
        "--cuda-checkpoint-bin",
        "cuda-checkpoint",
        "the cuda-checkpoint binary for the cli path",
        metavar="PATH",
    )

    app = o.group("app backend", "the workload's own offload and restore hooks")
    app.option(
        "--app-residual-mib",
        "2048",
        "device memory a process may keep after its release (CUDA context)",
        type=argtype(_number(0, inclusive=True)),
        metavar="MIB",
    )

    sim = o.group(EMULATION, "the sim backend's model of a node, and failures to inject")
    sim.option(
        "--sim-capacity-gb",
        "80",
        "device memory per node",
        type=argtype(_number(0, inclusive=False)),
        metavar="GB",
    )
    sim.option(
        "--sim-bandwidth-gbps",
        "50",
        "host<->device bandwidth per direction, in GB/s (bytes, not bits)",
        type=argtype(_number(0, inclusive=False)),
        metavar="GB_PER_S",
    )
    sim.option(
        "--sim-state-gb",
        "40",
        "device state of a job whose workers registered state_bytes=0",
        type=argtype(_number(0, inclusive=True)),
        metavar="GB",
    )
    sim.option(
        "--sim-time-scale",
        "1.0",
        "factor on modelled transfer time (0 = instantaneous)",
        type=argtype(_number(0, inclusive=True)),
        metavar="FACTOR",
    )
    sim.repeated(
        "--sim-fault",
        "inject a failure (checkpoint|restore : fail|hang [: job])",
        metavar="KIND:ACTION[:JOB]",
    )
    sim.option(
        "--host-memory-gb",
        "0",
        "model a host of this size instead of reading MemAvailable (0: read it)",
        type=argtype(_number(0, inclusive=True)),
        metavar="GB",
    )
    return o


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise InvalidArgument(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise InvalidArgument(f"port must be 0 to 65535, got {port}")
    return port


def _faults(parser: ServiceOptions, texts: list[str]) -> list[InjectedFault]:
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
    ns = parser.parse(argv)
    if ns.orchestrator is None:
        parser.error(f"--orchestrator (or {parser.env_name('--orchestrator')}) is required")
    node_text = ns.node if ns.node else socket.gethostname()
    try:
        node = validate_node(node_text)
    except InvalidArgument as exc:
        parser.error(str(exc))
    if ns.backend is None:
        # No default: a GPU node started without it must not silently emulate.
        parser.error(
            f"--backend (or {parser.env_name('--backend')}) is required: one of "
            f"{', '.join(k.value for k in BackendKind)} (sim only emulates)"
        )
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
        log_level=ns.log_level,
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
