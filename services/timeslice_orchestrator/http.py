"""HTTP side of a replica: /healthz (process up), /readyz (serving), /metrics (Prometheus),
and the live dashboard (``/``, ``/events``, ``/state``: :mod:`.dashboard`)."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from timeslice_orchestrator.dashboard import Dashboard
from timeslice_orchestrator.metrics import Metrics


def make_app(
    metrics: Metrics, ready: Callable[[], bool], dashboard: Dashboard | None = None
) -> web.Application:
    """The replica's HTTP app; ``dashboard`` adds the dashboard's routes."""

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")

    async def metrics_handler(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_handler)
    if dashboard is not None:
        app.router.add_routes(dashboard.routes())

        async def end_streams(_: web.Application) -> None:
            # Event streams never end by themselves: end them, or shutdown waits for them.
            dashboard.close_streams()

        app.on_shutdown.append(end_streams)
    return app
