"""Mutual TLS on every hop, with real processes and real certificates.

A TLS cluster (its own etcd with client-certificate auth and etcd auth, replicas serving
mutual TLS, agents with their node's certificate): refused certificates, identities taken
from certificates, a fake agent, certificate rotation under a hold, and etcd's refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import hashlib
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpclib.const
import pytest
from grpclib import GRPCError
from grpclib.client import Channel

from timeslice.aio import AsyncTimeSliceClient
from timeslice.errors import (
    CertificateExpired,
    InvalidArgument,
    PermissionDenied,
    TlsRefused,
    Unavailable,
    UntrustedCertificate,
)
from timeslice.targets import parse_address
from timeslice.tls import CA_ENV, CERT_ENV, KEY_ENV, TlsFiles, client_context
from timeslice_agent.stream import CONNECT_ROUTE
from timeslice_orchestrator.config import parse_args
from timeslice_orchestrator.store.etcd import EtcdClient, StoreUnavailable
from timeslice_proto.timeslice.v1 import (
    AgentHello,
    AgentMessage,
    GroupStatus,
    OrchestratorMessage,
)
from timeslice_tools.dev.certs import Pki
from timeslice_tools.dev.cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    with LocalCluster(replicas=1, agents=2, tls=True, base_dir=tmp_path / "c") as c:
        yield c


def _client(c: LocalCluster, job: str, cert: Path | None, key: Path | None) -> AsyncTimeSliceClient:
    assert c.pki is not None
    return AsyncTimeSliceClient(
        c.target,
        job_id=job,
        call_timeout=3,
        tls_ca=str(c.pki.ca),
        tls_cert=str(cert) if cert else None,
        tls_key=str(key) if key else None,
    )


def _expired(pki: Pki) -> tuple[Path, Path]:
    pair = pki.issue(
        "expired",
        common_name="late",
        uris=["timeslice://operator"],
        days=1,
        not_before=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3),
    )
    return pair.cert, pair.key


async def test_refused_certificates_get_a_tls_error_and_one_log_line(
    cluster: LocalCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pki = cluster.pki
    assert pki is not None
    other = Pki.create(tmp_path / "other-ca")
    cases = {
        "another CA": (other.operator.cert, other.operator.key, UntrustedCertificate),
        "expired": (*_expired(pki), CertificateExpired),
    }
    for what, (cert, key, named) in cases.items():
        client = _client(cluster, "j1", cert, key)
        try:
            with pytest.raises(Unavailable) as info:
                await client.acquire("g1")
        finally:
            await client.close()
        assert isinstance(info.value, named), (what, repr(info.value))
        assert f"refused our client certificate {cert}" in str(info.value), what
    # No certificate at all (none in the environment either): refused, named at once and
    # not retried, since nothing can change without a certificate.
    monkeypatch.delenv(CERT_ENV, raising=False)
    monkeypatch.delenv(KEY_ENV, raising=False)
    loop = asyncio.get_running_loop()
    for _ in range(3):
        client = _client(cluster, "j1", None, None)
        started = loop.time()
        try:
            with pytest.raises(Unavailable) as info:
                await client.acquire("g1")
        finally:
            await client.close()
        assert isinstance(info.value, TlsRefused), repr(info.value)
        assert "requires a client certificate" in str(info.value), info.value
        assert loop.time() - started < 2.0  # the call's budget is 3 s
    log = cluster.log_tail("r0", 400)
    # Each client retried for its whole call timeout; the replica logged each reason once.
    assert log.count("refused: certificate has expired") == 1, log
    assert log.count("refused: unable to get local issuer certificate") == 1, log
    # A good certificate still works.
    client = _client(cluster, "j1", pki.operator.cert, pki.operator.key)
    try:
        await client.acquire("g1")
    finally:
        await client.close()


async def test_a_job_certificate_acts_as_its_job_only(cluster: LocalCluster) -> None:
    pki = cluster.pki
    assert pki is not None
    mine = pki.job("j1")
    client = _client(cluster, "j1", mine.cert, mine.key)
    try:
        grant = await client.acquire("g1")
        assert grant.job_id == "j1"
    finally:
        await client.close()
    thief = _client(cluster, "j1", pki.job("j2").cert, pki.job("j2").key)
    try:
        with pytest.raises(PermissionDenied, match="may not act as job 'j1'"):
            await thief.acquire("g1")
    finally:
        await thief.close()
    # A node's certificate is not a job's either.
    node = _client(cluster, "j1", pki.node("node-0").cert, pki.node("node-0").key)
    try:
        with pytest.raises(PermissionDenied):
            await node.acquire("g2")
    finally:
        await node.close()


async def test_a_fake_agent_for_an_existing_node_is_refused(cluster: LocalCluster) -> None:
    pki = cluster.pki
    assert pki is not None
    impostor = pki.node("node-1")  # a real node's certificate, claiming another node
    ctx = await asyncio.to_thread(
        client_context, TlsFiles(str(pki.ca), str(impostor.cert), str(impostor.key))
    )
    host, port = parse_address(cluster.targets[0])
    channel = Channel(host, port, ssl=ctx)
    try:
        with pytest.raises(GRPCError) as info:
            async with channel.request(
                CONNECT_ROUTE,
                grpclib.const.Cardinality.STREAM_STREAM,
                AgentMessage,
                OrchestratorMessage,
                timeout=10,
            ) as stream:
                await stream.send_request()
                hello = AgentMessage(hello=AgentHello(node="node-0"))
                await stream.send_message(hello, end=True)
                await stream.recv_message()
    finally:
        channel.close()
    assert info.value.status is grpclib.const.Status.PERMISSION_DENIED
    assert "node 'node-0'" in (info.value.message or "")
    # The real agent of node-0 kept its stream.
    assert "agent node-0 disconnected" not in cluster.log_tail("r0", 400)


async def test_rotation_keeps_the_hold_and_new_connections_use_the_new_certificate(
    cluster: LocalCluster,
) -> None:
    pki = cluster.pki
    assert pki is not None
    holder = _client(cluster, "j1", pki.operator.cert, pki.operator.key)
    waiter = _client(cluster, "j2", pki.operator.cert, pki.operator.key)
    try:
        grant = await holder.acquire("g1")
        waiting = asyncio.create_task(waiter.acquire("g1", timeout=60))
        status = await _status_with_queue(holder, "g1")
        old = _file_fingerprint(pki.orchestrator.cert)
        assert await _served_fingerprint(cluster) == old
        # Rotate every certificate in place: the server's and the clients'.
        pki.issue(
            "orchestrator",
            common_name="timeslice-orchestrator",
            hosts=["localhost", "127.0.0.1", "::1"],
        )
        pki.issue("operator", common_name="operator", uris=["timeslice://operator"])
        await asyncio.sleep(1.5)  # past the files' check interval
        fresh = _client(cluster, "j3", pki.operator.cert, pki.operator.key)
        try:
            after = await fresh.status("g1")
        except Exception as exc:
            raise AssertionError(cluster.log_tail("r0", 40)) from exc
        finally:
            await fresh.close()
        assert after.holder_job_id == "j1"
        assert after.holder_epoch == grant.epoch == status.holder_epoch
        assert [q.job_id for q in after.queue] == ["j2"]
        # A new connection is served the new certificate (not the old one, reloaded or not).
        new = _file_fingerprint(pki.orchestrator.cert)
        assert new != old
        assert await _served_fingerprint(cluster) == new
        await holder.yield_("g1")
        second = await asyncio.wait_for(waiting, 30)
        assert second.job_id == "j2" and second.epoch > grant.epoch
    finally:
        await holder.close()
        await waiter.close()


def _file_fingerprint(path: Path) -> str:
    """SHA-256 of the first certificate in a PEM file (its DER form)."""
    pem = path.read_text()
    end = "-----END CERTIFICATE-----"
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem[: pem.index(end) + len(end)])).hexdigest()


async def _served_fingerprint(cluster: LocalCluster) -> str:
    """SHA-256 of the certificate a replica presents to a new TLS connection (DER)."""
    pki = cluster.pki
    assert pki is not None
    files = TlsFiles(str(pki.ca), str(pki.operator.cert), str(pki.operator.key))
    ctx = await asyncio.to_thread(client_context, files)
    host, port = parse_address(cluster.targets[0])
    _, writer = await asyncio.wait_for(asyncio.open_connection(host, port, ssl=ctx), 10)
    try:
        served = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()
        with contextlib.suppress(OSError, ssl.SSLError):
            await asyncio.wait_for(writer.wait_closed(), 5)
    assert served, "the replica presented no certificate"
    return hashlib.sha256(served).hexdigest()


async def _status_with_queue(client: AsyncTimeSliceClient, group: str) -> GroupStatus:
    async with asyncio.timeout(10):
        while True:
            status = await client.status(group)
            if status.queue:
                return status
            await asyncio.sleep(0.05)


async def test_etcd_refuses_a_client_without_its_certificate(cluster: LocalCluster) -> None:
    pki = cluster.pki
    assert pki is not None
    no_cert = EtcdClient([cluster.etcd_endpoint], timeout=2, tls=TlsFiles(str(pki.etcd_ca)))
    plain = EtcdClient([cluster.etcd_endpoint], timeout=2)
    ours = EtcdClient(
        [cluster.etcd_endpoint],
        timeout=2,
        tls=TlsFiles(str(pki.etcd_ca), str(pki.etcd_client.cert), str(pki.etcd_client.key)),
    )
    try:
        for client in (no_cert, plain):
            with pytest.raises(StoreUnavailable):
                await client.get(cluster.prefix.encode() + b"/x")
        # With our certificate: only our prefix (etcd auth, role limited to /timeslice/).
        await ours.get(cluster.prefix.encode() + b"/x")
        with pytest.raises(StoreUnavailable, match="permission denied"):
            await ours.put(b"/elsewhere", b"1")
    finally:
        for client in (no_cert, plain, ours):
            await client.close()


def test_plaintext_needs_insecure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIMESLICE_ORCHESTRATOR_INSECURE", raising=False)
    with pytest.raises(SystemExit):
        parse_args([])
    assert parse_args(["--insecure"]).insecure
    for name in ("TIMESLICE_INSECURE", CA_ENV, CERT_ENV, KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidArgument, match="no TLS configured"):
        AsyncTimeSliceClient("127.0.0.1:1", job_id="j")
    AsyncTimeSliceClient("127.0.0.1:1", job_id="j", insecure=True)
