"""Wiring of the agent: state file, backend, worker socket, HTTP, orchestrator link.

Start order: load the state file (refusing a file of another node), re-adopt saved jobs, write
the state back (a state file that cannot be written, on a full or read-only disk, holds the
start there: the agent says so once and retries, serving nothing until a write succeeds, and
never exits for it), serve the worker socket, serve HTTP, then dial the orchestrator. Stop
order (SIGTERM/SIGINT): refuse new directives and let running ones finish briefly, close the
stream, close the servers, save the state, remove the socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
from pathlib import Path

from grpclib.server import Server
from opentelemetry.sdk.trace import TracerProvider

from timeslice.tracing import provider_from_env, tracer_for
from timeslice.wire import strict_server
from timeslice_agent import __version__
from timeslice_agent.backends import Backend, create_backend
from timeslice_agent.config import AgentConfig, BackendKind, Discovery, Endpoint
from timeslice_agent.devmem import MemoryCheck
from timeslice_agent.discovery import Discovered, ProcessFinder
from timeslice_agent.executor import DirectiveExecutor, ExecutorSettings
from timeslice_agent.hostmem import GB, HostMemory
from timeslice_agent.http import HttpServer
from timeslice_agent.jobs import JobState, Residency
from timeslice_agent.journal import DirectiveJournal
from timeslice_agent.llmd import AcceleratorMemory, HealthService, SnapshotAgentService
from timeslice_agent.metrics import AgentMetrics
from timeslice_agent.nvml import (
    DeviceMemory,
    NvmlDeviceMemory,
    discover_devices,
    open_device_memory,
)
from timeslice_agent.operations import OrchestratorOperations
from timeslice_agent.procs import identity_of
from timeslice_agent.statefile import StateFileError, StateWriteError, load_state
from timeslice_agent.stream import OrchestratorLink
from timeslice_agent.tasks import Supervisor
from timeslice_agent.workers import WorkerLinkService, WorkerRegistry
from timeslice_proto.timeslice.v1 import AgentHello, Device, DirectiveAck, Welcome, WorkerInfo

log = logging.getLogger(__name__)

DRAIN_SECONDS = 5.0
# A hello waits this long at most for directives of an earlier stream to finish (each also
# has its own deadline, the orchestrator's directive timeout, 30 s by default).
SETTLE_SECONDS = 60.0
DISCOVERY_INTERVAL_SECONDS = 2.0
CLOSE_SECONDS = 5.0
# How long a registration waits for the orchestrator to record it. With the agent's check of
# the worker's process (up to 5 s) it stays within the 10 s the SDK's register() waits.
REGISTRATION_RECORD_SECONDS = 3.0
# A restarted agent waits this long at most, before its first hello, for the workers of the
# jobs its state file lists to register again (a registration reconnects every 2 s at most).
REREGISTER_SECONDS = 5.0
# While the state file cannot be written at start, the write is retried after these waits.
START_WRITE_RETRY_INITIAL_SECONDS = 0.2
START_WRITE_RETRY_MAX_SECONDS = 2.0
# ... and the agent says it still waits this often.
START_WRITE_REMIND_SECONDS = 60.0
_MAX_UNIX_PATH = 107
# Owner and group may connect; nobody else (registering is a request to be frozen/checkpointed).
WORKER_SOCKET_MODE = 0o660


class AgentStartError(Exception):
    """The agent cannot start (bad state file, socket in use, ...); the message says why."""


def _inspect_socket_path(path: Path) -> bool:
    """Create the parent directory; True if something exists at ``path`` (blocking)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise AgentStartError(f"{path} exists and is not a socket; not removing it")
    return True


async def prepare_socket_path(path: Path) -> None:
    """Create the socket's directory and remove a stale socket file.

    Refuses to touch a path that is not a socket, or a socket another process still serves.
    """
    if len(os.fsencode(path)) > _MAX_UNIX_PATH:
        raise AgentStartError(f"worker socket path {path} is longer than {_MAX_UNIX_PATH} bytes")
    if not await asyncio.to_thread(_inspect_socket_path, path):
        return
    try:
        async with asyncio.timeout(1.0):
            _, writer = await asyncio.open_unix_connection(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale worker socket %s", path)
        await asyncio.to_thread(path.unlink, missing_ok=True)
        return
    except (TimeoutError, OSError) as exc:
        raise AgentStartError(f"cannot tell whether {path} is in use: {exc!r}") from None
    writer.close()
    raise AgentStartError(f"another process is serving the worker socket {path}")


def bind_worker_socket(path: Path, group: int | None) -> socket.socket:
    """A unix socket bound at ``path`` with mode 0660 and ``group``, not yet listening (blocking).

    The mode and group are set between ``bind`` and ``listen``: until ``listen`` a connect is
    refused, so there is no moment in which the socket accepts anyone the mode would not.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        os.chmod(path, WORKER_SOCKET_MODE)
        os.chown(path, -1, os.getgid() if group is None else group)
    except OSError as exc:
        sock.close()
        raise AgentStartError(f"cannot create the worker socket {path}: {exc}") from None
    return sock


# The sim backend parks emulated bytes, so it measures against an emulated host as well: by
# default one the size of an 8-GPU server's DRAM, not this machine's.
SIM_HOST_GB = 2048.0


def _modelled_host_gb(config: AgentConfig) -> float:
    if config.host_memory_gb:
        return config.host_memory_gb
    return SIM_HOST_GB if config.backend is BackendKind.SIM else 0.0


class Agent:
    """One agent process; :meth:`run` until ``stop`` is set."""

    def __init__(
        self,
        config: AgentConfig,
        *,
        backend: Backend | None = None,
        tracing: TracerProvider | None = None,
    ) -> None:
        self.config = config
        self.tracing = tracing if tracing is not None else provider_from_env("timeslice-agent")
        self.backend = backend or create_backend(config)
        self.metrics = AgentMetrics(
            node=config.node,
            backend=self.backend.name,
            emulated=self.backend.emulated,
            mechanism=self.backend.mechanism,
        )
        self.supervisor = Supervisor(self.metrics)
        self.registry = WorkerRegistry(
            on_change=self._on_workers_changed, check=self._check_registration
        )
        self.executor = DirectiveExecutor(
            ExecutorSettings(
                node=config.node,
                state_file=config.state_file,
                hook_timeout=config.hook_timeout,
                host_memory=HostMemory(
                    reserve_bytes=int(config.host_reserve_gb * GB),
                    modelled_bytes=int(_modelled_host_gb(config) * GB),
                ),
            ),
            backend=self.backend,
            registry=self.registry,
            metrics=self.metrics,
            supervisor=self.supervisor,
            send_ack=self._send_ack,
            journal=DirectiveJournal(config.journal) if config.journal else None,
            tracer=tracer_for(self.tracing),
            rescan=self._rescan,
        )
        self.link = OrchestratorLink(
            node=config.node,
            targets=config.orchestrators,
            hello=self._hello,
            workers=self.registry.workers,
            host_available=self._host_available,
            on_directive=self.executor.handle,
            metrics=self.metrics,
            on_welcome=self._welcomed,
            settle=self._settle,
            tls=config.tls,
        )
        self.executor.stalled = self.link.stalled
        self.executor.durability.on_unwritable = self.link.state_unwritable
        self.executor.durability.on_writable = self.link.state_writable
        self.devices: list[Device] = []
        self.memory: DeviceMemory | None = None
        self.finder: ProcessFinder | None = None
        self._scan_lock = asyncio.Lock()
        self.http_address: Endpoint | None = None
        self._grpc: Server | None = None
        self._llmd: Server | None = None
        self.llmd_port: int | None = None
        self._http: HttpServer | None = None
        self._socket_inode: int | None = None
        self._link_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._state_owned = False

    # ----- callbacks -------------------------------------------------------------------------

    def _check_registration(self, info: WorkerInfo) -> None:
        self.executor.check_registration(info)

    def _on_workers_changed(self, job_id: str) -> None:
        self.metrics.registered_workers.set(len(self.registry))
        if self._stopping:
            # Registrations end because the agent stops, not because workers died: keep jobs.
            return
        self.executor.on_workers_changed(job_id)
        self.link.workers_changed()

    async def _registration_recorded(self) -> None:
        """Until the orchestrator has the worker set as it is now in etcd: a worker told it is
        registered may acquire at once, and a grant planned without it would leave its
        device state beside the holder's. Bounded; without a confirming orchestrator
        stream it does not wait (the worker goes out with the next hello)."""
        version = self.link.workers_version
        if not await self.link.workers_recorded(version, REGISTRATION_RECORD_SECONDS):
            if self.link.ready and self.link.records_workers:
                log.warning(
                    "the orchestrator has not confirmed worker set %d within %g s; telling "
                    "the worker it is registered anyway",
                    version,
                    REGISTRATION_RECORD_SECONDS,
                )

    def _on_registration_refused(self, reason: str) -> None:
        self.metrics.registrations_refused.labels(reason).inc()

    def _send_ack(self, ack: DirectiveAck) -> None:
        self.link.send_ack(ack)

    async def _rescan(self) -> None:
        if self.finder is None:
            return
        # One scan at a time: an older result must never overwrite a newer one.
        async with self._scan_lock:
            found = await self.finder.scan()
            self.registry.set_discovered(found + await self._parked(found))

    async def _parked(self, found: list[Discovered]) -> list[Discovered]:
        """Processes of jobs parked on the host, which NVML no longer lists.

        A checkpointed process holds no device context, so NVML stops reporting it; it is
        still the job's, and the orchestrator must keep seeing the job on this node, or it
        would grant the job again without restoring it here. Only the very processes the
        checkpoint pinned count: a pid reused since is not the job's.
        """
        seen = {(d.info.job_id, d.info.pid) for d in found}
        candidates = [
            Discovered(WorkerInfo(job_id=job.job_id, group_id=job.group_id, pid=i.pid), i)
            for job in self.executor.jobs.values()
            if job.residency is Residency.HOST
            for i in job.saved_identities
            if (job.job_id, i.pid) not in seen
        ]
        return await asyncio.to_thread(
            lambda: [d for d in candidates if identity_of(d.info.pid) == d.identity]
        )

    async def _discover_forever(self) -> None:
        while True:
            try:
                await self._rescan()
            except Exception as exc:
                # NVML or procfs hiccups are retried; the directive path rescans on its own.
                log.warning("process discovery failed: %r", exc)
            await asyncio.sleep(DISCOVERY_INTERVAL_SECONDS)

    async def _open_device_checks(self) -> None:
        """NVML for the memory checks and discovery; fails the start where it is required."""
        cfg = self.config
        discovery = cfg.discovery
        if discovery is Discovery.AUTO and not self.backend.frees_device_memory:
            # Finding processes only matters to backends that move their memory.
            discovery = Discovery.OFF
        if self.backend.frees_device_memory or discovery in (Discovery.AUTO, Discovery.NVML):
            self.memory = await asyncio.to_thread(open_device_memory)
        if discovery is Discovery.NVML and self.memory is None:
            raise AgentStartError("--discover nvml: NVML is not available on this machine")
        if self.backend.frees_device_memory:
            if self.memory is None:
                log.warning(
                    "backend %s: NVML is not available, so checkpoints are NOT verified to free "
                    "device memory and reported bytes are the workers' announcements",
                    self.backend.name,
                )
            else:
                self.executor.memory_check = MemoryCheck(
                    self.memory,
                    release_wait=cfg.device_check.release_wait,
                    residual_per_process=self.backend.residual_bytes_per_process,
                )
        if discovery is not Discovery.OFF:
            self.finder = ProcessFinder(
                node=cfg.node, memory=self.memory if discovery is not Discovery.PROCFS else None
            )
        source = self.finder.source if self.finder is not None else "off"
        self.metrics.describe(self.backend.mechanism, source)
        log.info(
            "backend %s runs %s; process discovery: %s",
            self.backend.name,
            self.backend.mechanism,
            source,
        )

    def _welcomed(self, welcome: Welcome) -> None:
        self.executor.adopt_fence(welcome.fence_revision)

    async def _settle(self) -> None:
        await self.executor.settle(SETTLE_SECONDS)

    def _hello(self) -> AgentHello:
        return AgentHello(
            node=self.config.node,
            backend=self.backend.name,
            emulated=self.backend.emulated,
            devices=list(self.devices),
            workers=self.registry.workers(),
            jobs=self.executor.reports(),
            epochs=self.executor.epoch_list(),
            agent_version=__version__,
            capacity_bytes=self.backend.capacity_bytes,
            default_state_bytes=self.backend.default_state_bytes,
            backend_mechanism=self.backend.mechanism,
            discovery=self.finder.source if self.finder is not None else "off",
            fence_revision=self.executor.fence_revision,
            heartbeats=True,
            host_available_bytes=self._host_available(),
            host_memory_modelled=host.modelled if (host := self._host) is not None else False,
        )

    @property
    def _host(self) -> HostMemory | None:
        return self.executor.parts.host_memory

    def _host_available(self) -> int | None:
        """Host memory free for parking now, as admission counts it (hello and heartbeats)."""
        host = self._host
        return host.report(self.executor.table.parked_bytes()) if host is not None else None

    # ----- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Bring everything up; raises :class:`AgentStartError` with a reason on failure."""
        cfg = self.config
        if cfg.tls is None:
            log.warning(
                "--insecure: the stream to the orchestrators is plaintext and unauthenticated"
            )
        # First make sure no live agent serves this socket: a second agent of the node must
        # not even read, let alone rewrite, the state file the first one owns.
        await prepare_socket_path(cfg.worker_socket)
        try:
            state = await asyncio.to_thread(load_state, cfg.state_file, cfg.node)
        except StateFileError as exc:
            raise AgentStartError(str(exc)) from None
        await self.executor.adopt(state)
        self._state_owned = True
        await self._first_write()
        self.devices = self.backend.devices(await discover_devices())
        await self._open_device_checks()
        await self._rescan()
        log.info(
            "node %s backend %s%s, %d device(s), state file %s",
            cfg.node,
            self.backend.name,
            " (EMULATED: modelled data movement, nothing is really moved)"
            if self.backend.emulated
            else "",
            len(self.devices),
            cfg.state_file,
        )
        # Strict decoding and a size limit: a worker's malformed or oversized message is
        # refused, typed, before a handler runs (timeslice.wire).
        self._grpc = strict_server(
            [
                WorkerLinkService(
                    self.registry,
                    on_refused=self._on_registration_refused,
                    recorded=self._registration_recorded,
                )
            ],
            cfg.max_message_bytes,
        )
        sock = await asyncio.to_thread(
            bind_worker_socket, cfg.worker_socket, cfg.worker_socket_group
        )
        try:
            await self._grpc.start(sock=sock)
        except BaseException:
            sock.close()
            raise
        self._socket_inode = os.stat(cfg.worker_socket).st_ino
        log.info("worker socket listening on %s", cfg.worker_socket)
        if cfg.llmd_port is not None:
            await self._start_llmd()
        if cfg.http is not None:
            self._http = HttpServer(cfg.http, self.metrics, lambda: self.link.ready)
            self.http_address = await self._http.start()
        self.supervisor.spawn(
            self.registry.sweep_forever(), name="worker-sweep", kind="sweep", critical=True
        )
        if self.finder is not None:
            self.supervisor.spawn(
                self._discover_forever(), name="process-discovery", kind="sweep", critical=True
            )
        self._link_task = self.supervisor.spawn(
            self._serve_orchestrators(), name="orchestrator-link", kind="link", critical=True
        )

    async def _serve_orchestrators(self) -> None:
        await self._workers_back(REREGISTER_SECONDS)
        await self.link.run_forever()

    async def _workers_back(self, timeout: float) -> None:
        """Before a restarted agent's first hello: wait (at most ``timeout`` s) until each job
        its state file lists on the devices or parked has a worker registered again.

        The agent acts only on processes it knows, and a restart forgot the registrations. A
        checkpoint of a job whose workers have not registered again would stop nothing (the
        freeze backend), and the workers, registering afterwards, would run beside the job
        given the devices; a parked job without them would not be planned on this node, and
        be granted while its processes here stay parked. Their registrations come back within
        a reconnect interval; the hello, and so every directive, waits for them. Not waited
        for: a parked job none of whose checkpointed processes lives any more (nothing will
        register for it), and a faulted one.
        """

        on_device = {
            j
            for j, job in self.executor.jobs.items()
            if job.state in (JobState.IDLE, JobState.RUNNING)
        }
        parked = {
            j: job.saved_identities
            for j, job in self.executor.jobs.items()
            if job.state is JobState.SAVED
        }

        def alive() -> set[str]:  # /proc reads, off the loop
            return {
                j for j, pinned in parked.items() if any(identity_of(i.pid) == i for i in pinned)
            }

        jobs = on_device | await asyncio.to_thread(alive)

        def missing() -> list[str]:
            return sorted(j for j in jobs if not self.registry.workers_of(j))

        waiting = missing()
        if not waiting:
            return
        log.info(
            "waiting up to %g s for the workers of %s to register again before the hello",
            timeout,
            ", ".join(waiting),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while waiting and loop.time() < deadline:
            await asyncio.sleep(0.05)
            waiting = missing()
        if waiting:
            log.warning(
                "no worker of %s registered again within %g s; saying hello without them",
                ", ".join(waiting),
                timeout,
            )

    async def _first_write(self) -> None:
        """Write the state file before serving anything; while that fails, retry.

        A full or read-only disk is an operator's matter that the agent cannot fix; exiting
        would only have its supervisor restart it into the same failure (or give up). So it
        says so once, retries with a bounded interval, and starts once a write succeeds.
        """
        path = self.config.state_file
        loop = asyncio.get_running_loop()
        delay = START_WRITE_RETRY_INITIAL_SECONDS
        since = reminded = loop.time()
        failed = False
        while True:
            try:
                await self.executor.store.save()
            except StateWriteError as exc:
                self.metrics.state_write_failures.inc()
                now = loop.time()
                if not failed:
                    failed = True
                    log.error(
                        "%s; not serving until it can be written: retrying at most every %g s",
                        exc,
                        START_WRITE_RETRY_MAX_SECONDS,
                    )
                elif now - reminded >= START_WRITE_REMIND_SECONDS:
                    reminded = now
                    log.error("%s (still, after %.0f s); retrying", exc, now - since)
                await asyncio.sleep(delay)
                delay = min(delay * 2, START_WRITE_RETRY_MAX_SECONDS)
                continue
            if failed:
                log.warning("the state file %s can be written now; starting", path)
            return

    def _accelerators(self) -> AcceleratorMemory | None:
        memory = self.memory
        return memory if isinstance(memory, NvmlDeviceMemory) else None

    async def _start_llmd(self) -> None:
        """Serve the llm-d reference's snapshot agent API on TCP (docs/llmd-agent.md)."""
        cfg = self.config
        assert cfg.llmd_port is not None
        service = SnapshotAgentService(
            self.registry,
            lambda: self.executor.jobs,
            memory=self._accelerators,
            on_refused=self._on_registration_refused,
            # Operator Snapshot / Restore go through the orchestrator, as this node.
            operations=OrchestratorOperations(cfg.node, cfg.orchestrators, cfg.tls),
        )
        health = HealthService(self.backend.name, lambda: self.link.ready)
        server = strict_server([service, health], cfg.max_message_bytes)
        try:
            await server.start(cfg.llmd_host, cfg.llmd_port)
        except OSError as exc:
            raise AgentStartError(
                f"cannot serve the llm-d API on {cfg.llmd_host}:{cfg.llmd_port}: {exc}"
            ) from None
        self._llmd = server
        # grpclib keeps its asyncio server private; port 0 needs the port it was given.
        sockets = getattr(server._server, "sockets", None) or ()
        self.llmd_port = int(sockets[0].getsockname()[1]) if sockets else cfg.llmd_port
        log.info("llm-d snapshot agent API listening on %s:%d", cfg.llmd_host, self.llmd_port)
        self.supervisor.spawn(
            server.wait_closed(), name="llmd-server", kind="server", critical=True
        )

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set (exit 0) or a critical task fails (exit 1)."""
        stop_wait = asyncio.create_task(stop.wait(), name="stop-wait")
        # The start may wait (for a writable state file): a stop request ends that wait.
        starting = asyncio.create_task(self.start(), name="agent-start")
        try:
            await asyncio.wait({starting, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not starting.done():
                starting.cancel()
                await asyncio.wait({starting})
        if starting.cancelled():
            log.info("stop requested before the agent started; shutting down")
            stop_wait.cancel()
            await self.shutdown()
            return 0
        exc = starting.exception()
        if isinstance(exc, AgentStartError):
            log.error("agent cannot start: %s", exc)
            stop_wait.cancel()
            await self.shutdown()
            return 2
        if exc is not None:
            stop_wait.cancel()
            raise exc
        fatal_wait = asyncio.create_task(self.supervisor.wait_fatal(), name="fatal-wait")
        try:
            done, _ = await asyncio.wait(
                {stop_wait, fatal_wait}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stop_wait.cancel()
            fatal_wait.cancel()
        code = 0
        if fatal_wait in done and not fatal_wait.cancelled():
            log.error("a critical task ended (%r); stopping the agent", fatal_wait.result())
            code = 1
        else:
            log.info("stop requested; shutting down")
        await self.shutdown()
        return code

    async def shutdown(self) -> None:
        """Stop in order; every step is bounded so a stuck part cannot hang the exit."""
        await self.executor.drain(DRAIN_SECONDS)
        self._stopping = True
        if self._link_task is not None:
            self.supervisor.cancel(self._link_task)
            await asyncio.wait({self._link_task}, timeout=CLOSE_SECONDS)
        if self._grpc is not None:
            self._grpc.close()
            try:
                async with asyncio.timeout(CLOSE_SECONDS):
                    await self._grpc.wait_closed()
            except TimeoutError:
                log.error("worker socket server did not close within %g s", CLOSE_SECONDS)
        if self._llmd is not None:
            self._llmd.close()
        self.registry.close("agent stopping")
        if self._llmd is not None:
            try:
                async with asyncio.timeout(CLOSE_SECONDS):
                    await self._llmd.wait_closed()
            except TimeoutError:
                log.error("llm-d API server did not close within %g s", CLOSE_SECONDS)
        if self._http is not None:
            await self._http.close()
        await self.supervisor.cancel_all(CLOSE_SECONDS)
        if self._state_owned:
            await self.executor.persist()
        if self.memory is not None:
            self.memory.close()
        self._remove_socket()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # flush queued spans
        log.info("agent %s stopped", self.config.node)

    def _remove_socket(self) -> None:
        path = self.config.worker_socket
        if self._socket_inode is None:
            return
        try:
            # Only our own socket: a newer agent may already have replaced it.
            if os.stat(path).st_ino == self._socket_inode:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove worker socket %s: %s", path, exc)
