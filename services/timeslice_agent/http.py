"""The agent's small HTTP server: ``/healthz``, ``/readyz`` and ``/metrics`` (aiohttp).

``/healthz`` answers 200 whenever the process serves at all; ``/readyz`` answers 200 only while
the stream to an orchestrator is up and welcomed (503 otherwise, with the reason), which is what
a Kubernetes readiness probe or a load test should wait for; ``/metrics`` is the Prometheus text
format of the agent's own registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from timeslice_agent.config import Endpoint
from timeslice_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)


class HttpServer:
    """Serves health, readiness and metrics on one ``HOST:PORT``."""

    def __init__(
        self, endpoint: Endpoint, metrics: AgentMetrics, is_ready: Callable[[], bool]
    ) -> None:
        self._endpoint = endpoint
        self._metrics = metrics
        self._is_ready = is_ready
        self._runner: web.AppRunner | None = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        if self._is_ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready: no welcomed orchestrator stream\n")

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def start(self) -> Endpoint:
        """Bind and serve; returns the bound address (useful with port 0)."""
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics_handler)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, self._endpoint.host, self._endpoint.port)
        await site.start()
        bound = self._endpoint
        for address in runner.addresses:
            if isinstance(address, tuple) and len(address) >= 2:
                bound = Endpoint(str(address[0]), int(address[1]))
                break
        log.info("http listening on %s", bound)
        return bound

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
