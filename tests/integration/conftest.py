"""Fixtures of the integration tests: a group store on its own prefix of the shared etcd."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.integration.groupstore import group_store
from timeslice_orchestrator.store.etcd import EtcdClient
from timeslice_orchestrator.store.groups import GroupStore
from timeslice_tools.dev.etcd import EtcdServer


@pytest.fixture
async def store(etcd_server: EtcdServer) -> AsyncIterator[GroupStore]:
    async with group_store(etcd_server.endpoint) as s:
        yield s


@pytest.fixture
async def etcd(etcd_server: EtcdServer) -> AsyncIterator[EtcdClient]:
    """A client of the worker's etcd, closed after the test."""
    client = EtcdClient([etcd_server.endpoint])
    yield client
    await client.close()
