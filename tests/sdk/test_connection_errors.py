"""A connection that fails says why, as its own type, and what to do: against real processes.

Real replicas (TLS with the session's CA, and plaintext), a closed port, a name that does not
resolve, certificates from another CA and expired ones. Every connection-level error is an
``Unavailable`` (the CLI exits "unreachable" on it); a missing or unreadable certificate file
is an ``InvalidArgument`` raised when the client is built, naming the path.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from grpclib.server import Server

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient
from timeslice.cli.base import ExitCode
from timeslice.errors import (
    CertificateExpired,
    CertificateFileError,
    ConnectionRefused,
    InvalidArgument,
    NameNotResolved,
    ServerRequiresTls,
    ServerWithoutTls,
    Timeout,
    TimeSliceError,
    Unavailable,
    UntrustedCertificate,
)
from timeslice.tls import CA_ENV, CERT_ENV, INSECURE_ENV, KEY_ENV, TlsFiles, server_context
from timeslice.wire import strict_server
from timeslice_tools.dev.certs import Pki

REPO = Path(__file__).resolve().parents[2]

# Each failure is retried (a server may be starting) until the call's budget ends.
BUDGET = 2.0


async def failure(target: str, **options: object) -> TimeSliceError:
    """What a first call (``groups``) of a client with ``options`` fails with."""
    client = AsyncTimeSliceClient(target, job_id="j", call_timeout=BUDGET, **options)  # type: ignore[arg-type]
    try:
        with pytest.raises(TimeSliceError) as info:
            await client.groups()
    finally:
        await client.close()
    return info.value


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tls_of(pki: Pki, pair: str = "operator") -> dict[str, str]:
    cert = pki.pair(pair)
    return {"tls_ca": str(pki.ca), "tls_cert": str(cert.cert), "tls_key": str(cert.key)}


def expired(pki: Pki, name: str, **hosts: list[str]) -> None:
    """Issue ``name`` from ``pki``'s CA, valid for a day that ended yesterday."""
    pki.issue(
        name,
        common_name=name,
        days=1,
        not_before=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=2),
        **hosts,  # type: ignore[arg-type]
    )


async def test_nothing_listening_is_named_with_its_address() -> None:
    target = f"127.0.0.1:{closed_port()}"
    error = await failure(target, insecure=True)
    assert type(error) is ConnectionRefused and isinstance(error, Unavailable)
    assert f"nothing listens on {target}" in error.message, error.message
    assert "is the orchestrator running" in error.message and "TLS" not in error.message
    # With TLS configured, still not a TLS error: no handshake ever began.
    error = await failure(target)
    assert type(error) is ConnectionRefused, error


async def test_an_acquire_with_a_timeout_says_nothing_answers() -> None:
    """The deadline passes because nothing answers: that is the error, not "not granted"."""
    target = f"127.0.0.1:{closed_port()}"
    async with AsyncTimeSliceClient(target, job_id="j", call_timeout=30, insecure=True) as c:
        with pytest.raises(TimeSliceError) as info:
            await c.acquire("g", timeout=2)
    assert isinstance(info.value, ConnectionRefused), repr(info.value)
    assert not isinstance(info.value, Timeout)
    assert f"nothing listens on {target}" in info.value.message


async def test_a_name_that_does_not_resolve() -> None:
    error = await failure("nonexistent.invalid:7070", insecure=True)
    assert type(error) is NameNotResolved and isinstance(error, Unavailable), error
    assert "'nonexistent.invalid'" in error.message and "does not resolve" in error.message


async def test_tls_on_one_side_only_and_wrong_or_expired_certificates(
    cluster_factory: ClusterFactory, session_pki: Pki, tmp_path: Path
) -> None:
    cluster = cluster_factory(agents=0)  # a real replica, mutual TLS with the session's CA
    target = cluster.targets[0]

    error = await failure(target, insecure=True)
    assert type(error) is ServerRequiresTls and isinstance(error, Unavailable), error
    assert f"{target} closed the connection without answering" in error.message
    assert "connect with TLS" in error.message

    other = await asyncio.to_thread(Pki.create, tmp_path / "other")
    # The server's certificate, checked against another deployment's CA.
    error = await failure(target, **tls_of(other))
    assert type(error) is UntrustedCertificate, error
    assert f"server at {target} is not signed by the CA in {other.ca}" in error.message
    # Our certificate, from a CA the server does not know.
    error = await failure(
        target,
        tls_ca=str(session_pki.ca),
        tls_cert=str(other.operator.cert),
        tls_key=str(other.operator.key),
    )
    assert type(error) is UntrustedCertificate, error
    assert f"{target} refused our client certificate {other.operator.cert}" in error.message
    assert f"not by the CA in {session_pki.ca}" in error.message, error.message

    # Our certificate from the right CA, but expired.
    await asyncio.to_thread(expired, session_pki, "expired-operator", uris=["timeslice://job/j"])
    error = await failure(target, **tls_of(session_pki, "expired-operator"))
    assert type(error) is CertificateExpired, error
    assert "expired" in error.message and "renew" in error.message, error.message


async def test_a_tls_client_against_a_plaintext_replica(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(agents=0, tls=False)
    target = cluster.targets[0]
    error = await failure(target)  # the session's TLS files, from the environment
    assert type(error) is ServerWithoutTls and isinstance(error, Unavailable), error
    assert f"{target} does not speak TLS" in error.message
    assert "insecure=True" in error.message


@pytest.fixture
async def expired_server(session_pki: Pki) -> AsyncIterator[str]:
    """A gRPC server (the replicas' strict server) presenting an expired certificate."""
    await asyncio.to_thread(
        expired, session_pki, "expired-server", hosts=["127.0.0.1", "localhost"]
    )
    pair = session_pki.pair("expired-server")
    context = await asyncio.to_thread(
        server_context, TlsFiles(str(session_pki.ca), str(pair.cert), str(pair.key))
    )
    server: Server = strict_server([])
    await server.start("127.0.0.1", 0, ssl=context)
    assert isinstance(server._server, asyncio.Server)
    try:
        yield f"127.0.0.1:{server._server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_an_expired_server_certificate(expired_server: str) -> None:
    error = await failure(expired_server)
    assert type(error) is CertificateExpired and isinstance(error, Unavailable), error
    assert f"certificate of the server at {expired_server} has expired" in error.message


async def test_a_missing_or_unreadable_certificate_file_names_its_path(
    session_pki: Pki, tmp_path: Path
) -> None:
    target = f"127.0.0.1:{closed_port()}"
    missing = tmp_path / "no-such-ca.crt"
    for options, path, why in [
        ({"tls_ca": str(missing)}, missing, "No such file or directory"),
        # A directory where a file belongs: unreadable as a file (root reads any mode).
        ({**tls_of(session_pki), "tls_key": str(tmp_path)}, tmp_path, "Is a directory"),
    ]:
        with pytest.raises(CertificateFileError) as info:
            AsyncTimeSliceClient(target, job_id="j", **options)  # type: ignore[arg-type]
        assert isinstance(info.value, InvalidArgument) and not isinstance(info.value, Unavailable)
        assert f"{path}: {why}" in info.value.message, info.value.message
    # A file that exists but is no certificate: at first use, still naming it, not retried.
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("not a certificate\n")
    loop = asyncio.get_running_loop()
    started = loop.time()
    error = await failure(target, tls_ca=str(garbage))
    assert type(error) is CertificateFileError, error
    assert f"TLS CA file {garbage} does not load" in error.message, error.message
    assert loop.time() - started < BUDGET / 2, "a configuration error is not retried"


def test_the_cli_prints_the_cause_and_exits_unreachable(tmp_path: Path) -> None:
    target = f"127.0.0.1:{closed_port()}"
    env = {k: v for k, v in os.environ.items() if k not in (CA_ENV, CERT_ENV, KEY_ENV)}
    env[INSECURE_ENV] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "timeslice.cli", "groups", "--target", target],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    print(done.stderr)
    assert done.returncode == ExitCode.UNREACHABLE, (done.returncode, done.stderr)
    assert f"nothing listens on {target}: is the orchestrator running" in done.stderr
    missing = tmp_path / "ca.crt"
    env.pop(INSECURE_ENV)
    env[CA_ENV] = str(missing)
    done = subprocess.run(
        [sys.executable, "-m", "timeslice.cli", "groups", "--target", target],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    print(done.stderr)
    assert done.returncode == ExitCode.USAGE, (done.returncode, done.stderr)
    assert f"TLS CA file {missing}: No such file or directory" in done.stderr
