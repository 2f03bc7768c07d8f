"""One orchestrator replica: wiring, start-up order, supervision and shutdown.

Every long-running task is supervised: if the etcd mirror, the lease keeper or a server dies,
the replica stops and exits non-zero (its supervisor restarts it; no state is lost because
none is kept here). Losing its lease means other replicas may already drive its groups, so
it exits at once rather than act on stale authority.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Coroutine
from typing import Any

from aiohttp import web
from grpclib.server import Server
from opentelemetry.sdk.trace import TracerProvider

from timeslice.tasks import Supervisor
from timeslice.tracing import provider_from_env, tracer_for
from timeslice_orchestrator.api import TimeSliceService
from timeslice_orchestrator.config import OrchestratorConfig
from timeslice_orchestrator.driver import DriverConfig, SwitchDriver
from timeslice_orchestrator.http import make_app
from timeslice_orchestrator.hub import AgentHub
from timeslice_orchestrator.locks import LockService
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.relay import DirectiveRouter
from timeslice_orchestrator.store.cache import Mirror
from timeslice_orchestrator.store.etcd import EtcdClient, LeaseKeeper
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.relay import RelayStore

log = logging.getLogger(__name__)

SYNC_TIMEOUT = 30.0
CLOSE_SECONDS = 5.0


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, tracing: TracerProvider | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.etcd = EtcdClient(config.etcd)
        self.keys = Keyspace(config.prefix)
        self.store = GroupStore(self.etcd, self.keys)
        self.mirror = Mirror(self.etcd, self.keys)
        # The replica cannot live without its lease keeper and mirror: either ending is fatal.
        self._tasks = Supervisor(f"replica {config.replica_id}")
        self._server: Server | None = None
        self._runner: web.AppRunner | None = None
        self._keeper: LeaseKeeper | None = None
        self._driver: SwitchDriver | None = None
        self._router: DirectiveRouter | None = None
        self._hub: AgentHub | None = None
        self._locks: LockService | None = None
        self._ready = False
        self._tracing = (
            tracing if tracing is not None else provider_from_env("timeslice-orchestrator")
        )

    def ready(self) -> bool:
        return (
            self._ready
            and self.mirror.synced.is_set()
            and self._keeper is not None
            and not self._keeper.lost.is_set()
        )

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.spawn(coro, name, kind=name, critical=True)

    async def start(self) -> None:
        cfg = self.config
        lease = await self._grant_lease()
        self._keeper = LeaseKeeper(self.etcd, lease, cfg.replica_ttl)
        self._spawn(self._keeper.run(), "lease-keeper")
        self._spawn(self.mirror.run(), "etcd-mirror")
        async with asyncio.timeout(SYNC_TIMEOUT):
            await self.mirror.synced.wait()
        self._hub = hub = AgentHub(
            self.store, cfg.replica_id, cfg.agent_ttl, self.metrics, cfg.agent_liveness_timeout
        )
        self._locks = locks = LockService(
            self.store, self.mirror, self.metrics, cfg.session_ttl, cfg.policy, cfg.max_hold
        )
        self._router = DirectiveRouter(
            hub, self.mirror, RelayStore(self.etcd, self.keys), cfg.replica_id, lease
        )
        self._router.start()
        self._driver = SwitchDriver(
            self.store,
            self.mirror,
            self._router,
            self.metrics,
            DriverConfig(
                replica_id=cfg.replica_id,
                directive_timeout=cfg.directive_timeout,
                co_residency=cfg.co_residency,
                prefetch=cfg.prefetch,
                policy=cfg.policy,
            ),
            lease,
            tracer_for(self._tracing),
        )
        self._driver.start()
        tracer = tracer_for(self._tracing)
        self._server = Server([TimeSliceService(locks, self.mirror, self.metrics, tracer), hub])
        await self._server.start(cfg.listen.host, cfg.listen.port)
        self._runner = web.AppRunner(make_app(self.metrics, self.ready), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.http.host, cfg.http.port)
        await site.start()
        self._ready = True
        log.info(
            "orchestrator %s listening on %s (http %s, etcd %s, prefix %s)",
            cfg.replica_id,
            cfg.listen,
            cfg.http,
            ",".join(cfg.etcd),
            cfg.prefix,
        )

    async def _grant_lease(self) -> int:
        deadline = asyncio.get_running_loop().time() + SYNC_TIMEOUT
        while True:
            try:
                return await self.etcd.grant_lease(self.config.replica_ttl)
            except Exception as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.warning("waiting for etcd at %s: %s", self.config.etcd, exc)
                await asyncio.sleep(0.5)

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set (0) or a supervised task ends (1)."""
        assert self._keeper is not None
        stopper = asyncio.create_task(stop.wait(), name="stop-signal")
        lost = asyncio.create_task(self._keeper.lost.wait(), name="lease-lost")
        fatal = asyncio.create_task(self._tasks.wait_fatal(), name="fatal-task")
        done, _ = await asyncio.wait({stopper, lost, fatal}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if lost in done:
            code = 1
            log.error("replica lease lost: stopping so others take over cleanly")
        if fatal in done:
            code = 1  # the supervisor logged the failure with its traceback
            log.error("a critical task ended (%r): stopping", fatal.result())
        for waiter in (stopper, lost, fatal):
            waiter.cancel()
        return code

    async def close(self) -> None:
        self._ready = False
        if self._locks is not None:
            self._locks.draining = True
        if self._driver is not None:
            await self._driver.stop()
        if self._router is not None:
            await self._router.stop()
        if self._hub is not None:
            self._hub.close()
            await asyncio.sleep(0.05)  # let the streams send their end before the server closes
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self._server.wait_closed()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._keeper is not None and not self._keeper.lost.is_set():
            # Revoking frees this replica's groups and agent records at once.
            with contextlib.suppress(Exception):
                await self.etcd.revoke_lease(self._keeper.lease_id)
        await self._tasks.cancel_all(CLOSE_SECONDS)
        await self.etcd.close()
        if self._tracing is not None:
            await asyncio.to_thread(self._tracing.shutdown)  # flush spans queued for export


async def serve(config: OrchestratorConfig) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    orchestrator = Orchestrator(config)
    try:
        await orchestrator.start()
        return await orchestrator.run(stop)
    finally:
        await orchestrator.close()
