"""Clients and decorated functions pickle as their settings, so a copy works in another process
(a Ray task or actor, a multiprocessing child): it opens its own session on first use."""

from __future__ import annotations

import asyncio
import multiprocessing
import pickle

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient, TimeSliceOrchestratorClient


def test_a_client_pickles_as_its_resolved_settings() -> None:
    # TLS files come from the environment (the suite's CA and certificate): resolved in the copy.
    original = AsyncTimeSliceClient(["h1:1", "h2:2"], job_id="j", session_ttl=7, call_timeout=3)
    copy = pickle.loads(pickle.dumps(original))
    assert isinstance(copy, AsyncTimeSliceClient) and copy is not original
    assert copy.settings() == original.settings()
    assert copy.settings()["tls_ca"] and not copy.settings()["insecure"]
    assert copy.session_id is None


def test_a_sync_client_and_its_scope_pickle_to_a_working_copy() -> None:
    with TimeSliceOrchestratorClient("h:1", job_id="j") as original:
        copy = pickle.loads(pickle.dumps(original))
        try:
            assert isinstance(copy, TimeSliceOrchestratorClient)
            assert copy.aio.settings() == original.aio.settings()
            assert not copy.closed  # its own loop thread runs
            scope = pickle.loads(pickle.dumps(original.on_accelerators("g", timeout=5)))
            assert (scope.group_id, scope.timeout) == ("g", 5.0)
        finally:
            copy.close()


def _hold_in_child(client: TimeSliceOrchestratorClient, out: multiprocessing.Queue[int]) -> None:
    @client.on_accelerators(group_id="g", timeout=30)
    def phase() -> int:
        return client.grants()["g"].epoch

    out.put(phase())
    client.close()


async def test_a_pickled_client_acquires_in_another_process(
    cluster_factory: ClusterFactory,
) -> None:
    cluster = cluster_factory(agents=0)
    context = multiprocessing.get_context("spawn")  # a fresh interpreter, like a Ray worker
    out: multiprocessing.Queue[int] = context.Queue()
    with TimeSliceOrchestratorClient(cluster.targets, job_id="parent") as client:
        child = context.Process(target=_hold_in_child, args=(client, out))
        child.start()
        try:
            epoch = await asyncio.to_thread(out.get, True, 60)
        finally:
            await asyncio.to_thread(child.join, 30)
        assert child.exitcode == 0 and epoch > 0
        assert client.session_id is None  # the parent never connected: the child did
        assert client.acquire("g", timeout=10).epoch > epoch  # the child gave it back
