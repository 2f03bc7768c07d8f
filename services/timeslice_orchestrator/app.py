"""One orchestrator replica: wiring, start-up order, supervision, rejoining and shutdown.

Every long-running task is supervised: if the etcd mirror, the membership loop or a server
dies, the replica stops and exits non-zero (its supervisor restarts it; no state is lost
because none is kept here).

A replica takes part in the cluster in terms. A term is one replica lease and what acts on
its authority: the switch driver (its writes compare the driver key's lease) and the
directive router (its relay posts live on the lease). When the lease is lost (etcd paused,
restarted or unreachable for longer than the replica TTL), other replicas may already drive
its groups, so the term ends at once: the driver and router stop and ``/readyz`` says not
ready. The process stays up: client calls are answered (typed UNAVAILABLE while etcd is
away), the mirror resumes its watch from the last revision it saw, and once etcd answers
again the replica revokes the lost lease (freeing its driver keys at once instead of a TTL
later), lets the mirror catch up, and starts a new term with a new lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from aiohttp import web
from grpclib.server import Server
from opentelemetry.sdk.trace import TracerProvider

from timeslice.backoff import Backoff
from timeslice.tasks import Supervisor
from timeslice.tracing import accept_trace_context, provider_from_env, tracer_for
from timeslice.wire import strict_server
from timeslice_orchestrator import admission, identity
from timeslice_orchestrator.admission import Admission
from timeslice_orchestrator.api import TimeSliceService
from timeslice_orchestrator.authz import Authorizer, load_operator_token
from timeslice_orchestrator.cleanup import IdleGroupCleaner
from timeslice_orchestrator.compat import CompatService
from timeslice_orchestrator.config import OrchestratorConfig
from timeslice_orchestrator.dashboard import Dashboard, dashboard_url
from timeslice_orchestrator.dashboard_pools import PoolsPanel
from timeslice_orchestrator.driver import SwitchDriver
from timeslice_orchestrator.group_metrics import GroupMetrics
from timeslice_orchestrator.http import make_app
from timeslice_orchestrator.hub import AgentHub
from timeslice_orchestrator.limits import Quotas
from timeslice_orchestrator.listener import TlsListener
from timeslice_orchestrator.locks import LockService
from timeslice_orchestrator.metrics import BatchMetrics, FeatureMetrics, Metrics
from timeslice_orchestrator.operations import NodeOperationsService
from timeslice_orchestrator.placements import DutyBook, PlacementService
from timeslice_orchestrator.reconcile import DriverConfig
from timeslice_orchestrator.relay import DirectiveRouter
from timeslice_orchestrator.store.etcd import EtcdClient, LeaseKeeper, StoreUnavailable
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_orchestrator.store.handover import CURRENT_FEATURES
from timeslice_orchestrator.store.idle import IdleStore
from timeslice_orchestrator.store.keys import Keyspace
from timeslice_orchestrator.store.pools import PoolStore
from timeslice_orchestrator.store.relay import RelayStore

log = logging.getLogger(__name__)
T = TypeVar("T")

CLOSE_SECONDS = 5.0
# How far behind etcd the mirror may be when a term starts: longer, and the rejoin is retried.
REJOIN_CATCH_UP = 10.0
# Retries of a rejoin while etcd is still away (doubling up to the cap).
REJOIN_BACKOFF = (0.1, 1.0)
# How often the etcd client certificate files are checked for a rotation.
TLS_CHECK_SECONDS = 2.0


@dataclass(eq=False)
class Term:
    """One term of this replica: its lease and what acts on the lease's authority.

    Nothing of a term is reused by the next one: its driver and router were built with its
    lease, and every write they make compares it.
    """

    lease: int
    keeper: LeaseKeeper
    router: DirectiveRouter
    driver: SwitchDriver

    @property
    def lost(self) -> bool:
        return self.keeper.lost.is_set()


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, tracing: TracerProvider | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.etcd = EtcdClient(
            config.etcd,
            tls=config.etcd_tls,
            timeout=config.etcd_timeout,
            probe=config.etcd_probe,
        )
        self.keys = Keyspace(config.prefix)
        self.store = GroupStore(self.etcd, self.keys)
        self.mirror = Mirror(self.etcd, self.keys, name=config.replica_id)
        self._group_metrics = GroupMetrics(self.mirror, self.metrics.hold_seconds)
        self.metrics.registry.register(self._group_metrics)
        self.metrics.registry.register(BatchMetrics(self.etcd.batcher))
        # Expected vs measured duty of the placement pools' groups (docs/placement.md).
        self._placement_duty = DutyBook(self.mirror)
        self.metrics.registry.register(self._placement_duty)
        mirror = self.mirror
        self.metrics.registry.register(
            FeatureMetrics(lambda: stored.record if (stored := mirror.features()) else None)
        )
        # The dashboard shows the hold tracker's figures (the same as /metrics), not its own.
        self.dashboard = Dashboard(
            self.mirror,
            self._group_metrics.tracker,
            config.dashboard,
            replica=config.replica_id,
            registry=self.metrics.registry,
            pools=PoolsPanel(PoolStore(self.etcd, self.keys), self._placement_duty),
        )
        # The replica cannot live without its mirror and its membership loop: either ending
        # is fatal. Losing the lease is not (see the module docstring).
        self._tasks = Supervisor(f"replica {config.replica_id}")
        self._server: Server | None = None
        self._runner: web.AppRunner | None = None
        self._term: Term | None = None
        self._membership: asyncio.Task[None] | None = None
        self._hub: AgentHub | None = None
        self._locks: LockService | None = None
        self._ready = False
        self.tls: TlsListener | None = None
        self.terms = 0
        """Terms started so far: 1 after start, one more per rejoin."""
        self._tracing = (
            tracing if tracing is not None else provider_from_env("timeslice-orchestrator")
        )

    @property
    def lease(self) -> int | None:
        """The lease of the current term; None between a lost lease and the rejoin."""
        return self._term.lease if self._term is not None else None

    def ready(self) -> bool:
        term = self._term
        return (
            self._ready
            and self.mirror.synced.is_set()
            and term is not None
            and not term.lost
            and not term.keeper.failing
        )

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._tasks.spawn(coro, name, kind=name, critical=True)

    async def start(self) -> None:
        cfg = self.config
        await self._first_answer(lambda: self.etcd.get(self.keys.root))
        # Before this replica writes anything: an empty keyspace is a new deployment.
        if await self._first_answer(self.store.start_features):
            log.info("new deployment under %s: features %s", cfg.prefix, CURRENT_FEATURES)
        self._spawn(self.mirror.run(), "etcd-mirror")
        try:
            async with asyncio.timeout(cfg.start_timeout):
                await self.mirror.synced.wait()
        except TimeoutError:
            raise StoreUnavailable(
                f"etcd at {','.join(cfg.etcd)} did not complete a first read of "
                f"{cfg.prefix} within {cfg.start_timeout:g} s"
            ) from None
        self._group_metrics.start()
        self.dashboard.start()  # after the tracker's listener: it reads the tracker
        # Not critical: the page's chart stops moving, nothing else does.
        self._tasks.spawn(self.dashboard.run(), "dashboard-sampler", kind="dashboard")
        self._hub = hub = AgentHub(
            self.store, cfg.replica_id, cfg.agent_ttl, self.metrics, cfg.agent_liveness_timeout
        )
        self.dashboard.hosts = hub  # the host memory free its agents report (nodes view)
        self._locks = locks = LockService(
            self.store, self.mirror, self.metrics, cfg.session_ttl, cfg.policy, cfg.max_hold
        )
        # Granted once the first read is in, which on a large deployment takes longer than
        # the lease's TTL: a lease granted before it would run out before its keeper starts.
        lease = await self._first_answer(lambda: self.etcd.grant_lease(cfg.replica_ttl))
        self._term = self._begin_term(lease)
        self._membership = self._spawn(self._keep_membership(), "membership")
        tracer = tracer_for(self._tracing)
        authz = await self._authorizer()
        quotas = Quotas(cfg.limits, self.mirror)
        admitter = Admission.from_limits(cfg.limits, self.metrics)
        api = TimeSliceService(
            locks,
            self.mirror,
            self.metrics,
            tracer,
            authz,
            quotas,
            admitter,
            strict_groups=cfg.strict_groups,
        )
        # Strict decoding and a message size limit: malformed or oversized requests are
        # refused, typed, before a handler runs (timeslice.wire).
        # The llm-d reference's v1alpha1 API, on the same port (docs/migrating-from-llm-d.md).
        compat = CompatService(
            locks, self.store, self.mirror, self.metrics, tracer, quotas, self._tasks,
            cfg.compat_hold_ttl,
        )  # fmt: skip
        # Operator snapshot / restore asked by a node's agent (docs/llmd-agent.md).
        operations = NodeOperationsService(
            self.store, self.mirror, self.metrics, co_residency=cfg.co_residency, tracer=tracer
        )
        # Jobs ask for a role in a pool; launchers place them (docs/placement.md).
        placement = PlacementService(
            PoolStore(self.etcd, self.keys), self.mirror, self.metrics, tracer, authz,
            cfg.replica_id, self._placement_duty,
        )  # fmt: skip
        self._server = strict_server(
            [api, hub, compat, operations, placement], cfg.limits.max_message_bytes
        )
        # Token buckets per client (its certificate's identity; per connection without TLS):
        # a flood from one client waits, or is refused, before
        # its requests are read, and other clients keep their latency (admission.py).
        admission.install(self._server, admitter)
        if self._tracing is not None:
            accept_trace_context(self._server)  # a job's span is the parent of its calls'
        if cfg.limits.idle_group_ttl > 0:
            cleaner = IdleGroupCleaner(
                IdleStore(self.etcd, self.keys), self.mirror, cfg.limits, self.metrics
            )
            self._spawn(cleaner.run(), "idle-group-cleanup")
        await self._listen(self._server)
        self._runner = web.AppRunner(
            make_app(self.metrics, self.ready, self.dashboard),
            access_log=None,
            shutdown_timeout=CLOSE_SECONDS,
        )
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
        # Where people find the page (the port really bound, for --http HOST:0 too).
        addresses = self._runner.addresses
        bound = int(addresses[0][1]) if addresses else cfg.http.port
        log.info("dashboard at %s", dashboard_url(cfg.http.host, bound))

    async def _authorizer(self) -> Authorizer:
        """Who is an operator: the token file is read once, at start (restart to rotate)."""
        path = self.config.operator_token_file
        if not path:
            log.warning(
                "no operator token (--operator-token-file): only operator certificates may "
                "use operator RPCs"
            )
            return Authorizer(self.metrics)
        token = await asyncio.to_thread(load_operator_token, path)
        return Authorizer(self.metrics, token)

    async def _listen(self, server: Server) -> None:
        """Serve the gRPC port: mutual TLS with identities, or plaintext if chosen."""
        cfg = self.config
        if cfg.tls is None:
            log.warning(
                "--insecure: the gRPC port %s is plaintext and unauthenticated; any client "
                "that reaches it may act as any job or node",
                cfg.listen,
            )
            await server.start(cfg.listen.host, cfg.listen.port)
        else:
            identity.install(server, cfg.identity)
            self.tls = TlsListener(
                cfg.tls, self.metrics, self._tasks, cfg.connections, cfg.identity
            )
            await self.tls.start(server, cfg.listen.host, cfg.listen.port)
        if cfg.etcd_tls is None:
            log.warning("--insecure: etcd at %s is reached in plaintext", ",".join(cfg.etcd))
        else:
            self._tasks.spawn(self._refresh_etcd_tls(), "etcd-tls-reload", kind="tls-reload")

    async def _refresh_etcd_tls(self) -> None:
        """Follow rotations of the etcd client certificate (grpc cannot swap it in place)."""
        while True:
            await asyncio.sleep(TLS_CHECK_SECONDS)
            try:
                await self.etcd.refresh_tls()
            except Exception:  # never let a bad rotation end the loop: log and check again
                log.exception("reloading the etcd TLS certificate failed")

    async def _first_answer(self, call: Callable[[], Awaitable[T]]) -> T:
        """What ``call`` returns, asked again (saying so) while etcd does not answer, until
        the start timeout."""
        deadline = asyncio.get_running_loop().time() + self.config.start_timeout
        while True:
            try:
                return await call()
            except Exception as exc:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                log.warning("waiting for etcd at %s: %s", self.config.etcd, exc)
                await asyncio.sleep(0.5)

    # -- terms ----------------------------------------------------------------------------

    def _begin_term(self, lease: int) -> Term:
        cfg = self.config
        assert self._hub is not None and self._locks is not None
        keeper = LeaseKeeper(self.etcd, lease, cfg.replica_ttl)
        # Not critical: its end (a lost lease) ends the term, which the membership loop
        # watches; a crash sets ``lost`` too (see LeaseKeeper.run).
        self._tasks.spawn(keeper.run(), f"lease-keeper-{lease:x}", kind="lease-keeper")
        router = DirectiveRouter(
            self._hub, self.mirror, RelayStore(self.etcd, self.keys), cfg.replica_id, lease
        )
        router.start()
        driver = SwitchDriver(
            self.store,
            self.mirror,
            router,
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
            hand_overs=self._locks.hand_overs,
        )
        driver.start()
        self.terms += 1
        self.metrics.replica_terms.inc()
        return Term(lease, keeper, router, driver)

    async def _end_term(self, term: Term) -> None:
        """Stop everything acting on ``term``'s lease (bounded: the lease fences a straggler)."""
        try:
            async with asyncio.timeout(CLOSE_SECONDS):
                await term.driver.stop()
        except TimeoutError:
            log.error("the driver of lease %x did not stop within %g s", term.lease, CLOSE_SECONDS)
        try:
            async with asyncio.timeout(CLOSE_SECONDS):
                await term.router.stop()
        except TimeoutError:
            log.error("the router of lease %x did not stop within %g s", term.lease, CLOSE_SECONDS)

    async def _keep_membership(self) -> None:
        """End each term as soon as its lease is lost, and start the next once etcd is back."""
        loop = asyncio.get_running_loop()
        while True:
            term = self._term
            assert term is not None
            await term.keeper.lost.wait()
            lost_at = loop.time()
            log.error(
                "replica lease %x lost: no longer driving, rejoining when etcd is back",
                term.lease,
            )
            await self._end_term(term)
            self._term = None
            lease = await self._rejoin(term.lease)
            self._term = self._begin_term(lease)
            log.warning(
                "rejoined with lease %x, %.1f s after lease %x was lost",
                lease,
                loop.time() - lost_at,
                term.lease,
            )

    async def _rejoin(self, lost: int) -> int:
        """Wait until etcd answers, then revoke ``lost`` and grant a new lease.

        Revoking drops what the lost lease still holds in etcd (an etcd restart extends every
        lease by its TTL): our driver keys and relay posts go at once, so groups are driven
        again within moments, by us or by another replica. The mirror then catches up with
        the store as of now, so the new term's driver starts from what etcd holds after the
        outage, not from before it. Retried (with backoff) until etcd is back; each step has
        the etcd client's deadline.
        """
        backoff = Backoff(*REJOIN_BACKOFF, jitter=False)
        revoked = False
        while True:
            try:
                if not revoked:
                    await self.etcd.revoke_lease(lost)  # an expired lease counts as revoked
                    revoked = True
                await self.mirror.catch_up(REJOIN_CATCH_UP)
                return await self.etcd.grant_lease(self.config.replica_ttl)
            except StoreUnavailable as exc:
                log.info("rejoin: etcd not back yet (%s)", exc)
            await asyncio.sleep(backoff.next_delay())

    # -- running --------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set (0) or a supervised task ends (1)."""
        stopper = asyncio.create_task(stop.wait(), name="stop-signal")
        fatal = asyncio.create_task(self._tasks.wait_fatal(), name="fatal-task")
        done, _ = await asyncio.wait({stopper, fatal}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if fatal in done:
            code = 1  # the supervisor logged the failure with its traceback
            log.error("a critical task ended (%r): stopping", fatal.result())
        for waiter in (stopper, fatal):
            waiter.cancel()
        return code

    async def close(self) -> None:
        self._ready = False
        self._group_metrics.stop()
        self.dashboard.stop()
        if self._locks is not None:
            self._locks.draining = True
        if self._membership is not None:
            # First, so that no term starts while this one is taken down.
            self._tasks.cancel(self._membership)
            await asyncio.wait({self._membership}, timeout=CLOSE_SECONDS)
        term, self._term = self._term, None
        if term is not None:
            await self._end_term(term)
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
        if term is not None and not term.lost:
            # Revoking frees this replica's groups and agent records at once.
            with contextlib.suppress(Exception):
                await self.etcd.revoke_lease(term.lease)
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
