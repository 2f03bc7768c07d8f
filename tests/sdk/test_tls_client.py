"""The SDK names a TLS refusal instead of timing out, and does not retry one that cannot heal.

A real grpclib server on loopback that requires client certificates (as every orchestrator
replica does); the clients differ only in what they present.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator

import pytest
from grpclib.server import Server

from timeslice._transport import map_error
from timeslice.aio import AsyncTimeSliceClient
from timeslice.errors import TlsRefused, Unavailable, UntrustedCertificate
from timeslice.tls import CERT_ENV, KEY_ENV, TlsFiles, server_context
from timeslice_tools.dev.certs import Pki


@pytest.fixture
async def tls_server(session_pki: Pki) -> AsyncIterator[str]:
    """A server with no services that requires a client certificate from the session's CA."""
    pair = session_pki.orchestrator
    files = TlsFiles(str(session_pki.ca), str(pair.cert), str(pair.key))
    context = await asyncio.to_thread(server_context, files)
    server = Server([])
    await server.start("127.0.0.1", 0, ssl=context)
    assert isinstance(server._server, asyncio.Server)
    port = server._server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def test_no_client_certificate_is_named_at_once(
    tls_server: str, session_pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The session's environment names a certificate; this client must have none at all.
    monkeypatch.delenv(CERT_ENV)
    monkeypatch.delenv(KEY_ENV)
    loop = asyncio.get_running_loop()
    for _ in range(5):  # the same every time, not a race that a retry may lose
        client = AsyncTimeSliceClient(
            tls_server, job_id="j", call_timeout=5, tls_ca=str(session_pki.ca)
        )
        started = loop.time()
        try:
            with pytest.raises(TlsRefused) as info:
                await client.acquire("g")
        finally:
            await client.close()
        elapsed = loop.time() - started
        assert isinstance(info.value, Unavailable)
        assert info.value.final
        assert "TLS" in str(info.value), info.value
        assert "requires a client certificate" in str(info.value), info.value
        # Not retried until the call's budget ends (5 s): nothing can change without a
        # certificate.
        assert elapsed < 4.0, elapsed


async def test_a_certificate_from_another_ca_is_named_when_the_budget_ends(
    tls_server: str, session_pki: Pki, tmp_path: object
) -> None:
    other = await asyncio.to_thread(Pki.create, f"{tmp_path}/other")
    client = AsyncTimeSliceClient(
        tls_server,
        job_id="j",
        call_timeout=4,
        tls_ca=str(session_pki.ca),
        tls_cert=str(other.operator.cert),
        tls_key=str(other.operator.key),
    )
    try:
        # A refused certificate may heal (a rotation in progress): retried, then named.
        with pytest.raises(Unavailable) as info:
            await client.acquire("g")
    finally:
        await client.close()
    assert isinstance(info.value, UntrustedCertificate), repr(info.value)
    assert f"refused our client certificate {other.operator.cert}" in str(info.value)
    assert "signed by another CA" in str(info.value), info.value


@pytest.mark.parametrize(
    ("reason", "final", "expected"),
    [
        ("TLSV13_ALERT_CERTIFICATE_REQUIRED", True, "requires a client certificate"),
        ("CERTIFICATE_REQUIRED", True, "requires a client certificate"),
        ("TLSV1_ALERT_UNKNOWN_CA", False, "does not trust the CA"),
        ("SSLV3_ALERT_CERTIFICATE_EXPIRED", False, "has expired"),
        ("WRONG_VERSION_NUMBER", False, "does not speak TLS"),
    ],
)
def test_alerts_map_to_named_refusals(reason: str, final: bool, expected: str) -> None:
    exc = ssl.SSLError(1, f"[SSL: {reason}] alert")
    exc.reason = reason
    error = map_error(exc, "Acquire(g) via h:1")
    assert isinstance(error, TlsRefused) and isinstance(error, Unavailable)
    assert error.final is final
    assert str(error).startswith("Acquire(g) via h:1: TLS error: ")
    assert expected in str(error)
