from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.tracing.otlp import Collector, start_collector


@pytest.fixture
async def collector() -> AsyncIterator[tuple[Collector, int]]:
    """A real OTLP receiver: (its spans, its port)."""
    server, receiver, port = await start_collector()
    try:
        yield receiver, port
    finally:
        await server.stop(grace=None)
