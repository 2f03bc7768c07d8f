"""TLS for every gRPC hop: certificate files, contexts that follow file rotation, the one rule
for when plaintext is allowed.

Certificates come from files (cert-manager and Vault rewrite them in place). Nothing here runs
a background task: a :class:`ReloadingContext` checks the files' ``stat`` (cheap, at most once
per ``check_interval``) when a *new* connection is about to be made, and rebuilds its
:class:`ssl.SSLContext` off the event loop when they changed. Connections already open keep the
context they were made with, so a running hold survives a rotation; the next connection uses
the new certificate.

The SDK reads its files from its constructor's arguments or from ``$TIMESLICE_TLS_CA``,
``$TIMESLICE_TLS_CERT`` and ``$TIMESLICE_TLS_KEY``. Plaintext needs an explicit choice:
``insecure=True``, ``$TIMESLICE_INSECURE=1``, a ``unix:`` target (a local socket, protected
by its file mode), or no TLS file at all together with one of those.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from grpclib.config import Configuration
from grpclib.protocol import H2Protocol

from timeslice._channel import LiveChannel
from timeslice._connection_errors import (
    describe_tls_error,
    diagnose,
    refused_after_handshake,
    requires_certificate,
)
from timeslice.errors import CertificateFileError, InvalidArgument
from timeslice.targets import HostPort, Target, UnixSocket

__all__ = [
    "CA_ENV",
    "CERT_ENV",
    "INSECURE_ENV",
    "KEY_ENV",
    "ReloadingContext",
    "TlsChannel",
    "TlsFiles",
    "client_context",
    "client_tls",
    "client_tls_from_env",
    "describe_tls_error",
    "requires_certificate",
]

log = logging.getLogger("timeslice.tls")

CA_ENV = "TIMESLICE_TLS_CA"
CERT_ENV = "TIMESLICE_TLS_CERT"
KEY_ENV = "TIMESLICE_TLS_KEY"
INSECURE_ENV = "TIMESLICE_INSECURE"

# How often, at most, a context stats its files before a new connection (rotation tools
# replace files within seconds of each other; a second of lag is well below any cert's life).
CHECK_INTERVAL = 1.0


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files: the CA bundle that verifies the peer, and our own certificate chain and key.

    ``cert`` and ``key`` go together; without them a client cannot pass mutual TLS.
    """

    ca: str
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise InvalidArgument("a TLS certificate and its key must be given together")

    def paths(self) -> tuple[str, ...]:
        return tuple(p for p in (self.ca, self.cert, self.key) if p is not None)

    def check(self) -> None:
        """Load the files once (blocking): a service refuses to start on a missing,
        unreadable or malformed file instead of retrying with it for ever.

        Raises:
            InvalidArgument: naming the file, or the files, and why.
        """
        self.check_readable()
        try:
            client_context(self)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise self.load_error(exc) from None

    def load_error(self, exc: Exception) -> CertificateFileError:
        """The error for files that are readable but do not load, naming the one at fault
        (OpenSSL's own error names none). Reads the files again (blocking)."""
        try:
            ssl.create_default_context(cafile=self.ca)
        except (ssl.SSLError, OSError, ValueError) as ca_exc:
            return CertificateFileError(
                f"TLS CA file {self.ca} does not load: is it a PEM certificate? ({ca_exc})"
            )
        if self.cert is not None and self.key is not None:
            return CertificateFileError(
                f"TLS certificate {self.cert} and key {self.key} do not load: are they PEM, "
                f"and the key the certificate's? ({exc})"
            )
        return CertificateFileError(f"TLS files {', '.join(self.paths())} do not load: {exc}")

    def check_readable(self) -> None:
        """Each file exists and this process may read it (a few ``open`` calls).

        Raises:
            CertificateFileError: naming the file and why.
        """
        for path, what in ((self.ca, "CA"), (self.cert, "certificate"), (self.key, "key")):
            if path is None:
                continue
            try:
                with open(path, "rb"):
                    pass
            except OSError as exc:
                raise CertificateFileError(
                    f"TLS {what} file {path}: {exc.strerror or exc}: check the path "
                    "(tls_ca=, tls_cert=, tls_key=, or $TIMESLICE_TLS_CA, _CERT, _KEY) and "
                    "that this user may read it"
                ) from None

    def stamp(self) -> tuple[tuple[int, int, int], ...]:
        """What changes when a file is rewritten or replaced (a rename, as Kubernetes does)."""
        out = []
        for path in self.paths():
            try:
                st = os.stat(path)
            except OSError:
                out.append((0, 0, 0))
            else:
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
        return tuple(out)


def _base(purpose: ssl.Purpose, files: TlsFiles) -> ssl.SSLContext:
    ctx = ssl.create_default_context(purpose=purpose, cafile=files.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    if files.cert is not None and files.key is not None:
        ctx.load_cert_chain(files.cert, files.key)
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """A client context that verifies the server against ``files.ca`` (reads the files)."""
    return _base(ssl.Purpose.SERVER_AUTH, files)


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """A server context that requires a client certificate signed by ``files.ca``."""
    if files.cert is None:
        raise InvalidArgument("a TLS server needs a certificate and a key")
    ctx = _base(ssl.Purpose.CLIENT_AUTH, files)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ReloadingContext:
    """The current :class:`ssl.SSLContext` built from ``files``, rebuilt when they change.

    :meth:`current` is what a new connection should use: the first call builds the context
    (in a thread), later ones stat the files at most every ``check_interval`` seconds and
    rebuild (in a thread) when they changed. A rebuild that fails (a certificate already
    replaced but not yet its key) keeps the previous context and is tried again at the next
    check; a first build that fails raises. :meth:`load` builds synchronously (start-up, to
    refuse bad files before serving).
    """

    def __init__(
        self,
        files: TlsFiles,
        build: Callable[[TlsFiles], ssl.SSLContext],
        *,
        check_interval: float = CHECK_INTERVAL,
        name: str = "TLS",
    ) -> None:
        self.files = files
        self._build = build
        self._interval = check_interval
        self._name = name
        self._stamp = files.stamp()
        self._context: ssl.SSLContext | None = None
        self._checked_at = 0.0
        self._lock = asyncio.Lock()
        self.reloads = 0
        """How many times a changed set of files was loaded (tests and metrics read it)."""

    def load(self) -> ssl.SSLContext:
        """Build the context now (blocking).

        Raises:
            CertificateFileError: a file is missing, unreadable or does not load (its path
                named: OpenSSL's own errors do not name it).
        """
        self._stamp = self.files.stamp()
        self.files.check_readable()
        try:
            self._context = self._build(self.files)
        except (ssl.SSLError, ValueError) as exc:
            raise self.files.load_error(exc) from None
        return self._context

    async def current(self) -> ssl.SSLContext:
        if self._context is None:
            async with self._lock:
                if self._context is None:
                    await asyncio.to_thread(self.load)
        assert self._context is not None
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._checked_at < self._interval:
            return self._context
        async with self._lock:
            if loop.time() - self._checked_at < self._interval:
                return self._context
            self._checked_at = loop.time()
            # A few stat calls: cheap enough for the loop; reading happens in a thread.
            stamp = self.files.stamp()
            if stamp == self._stamp:
                return self._context
            try:
                context = await asyncio.to_thread(self._build, self.files)
            except (OSError, ssl.SSLError, ValueError) as exc:
                log.warning(
                    "%s files changed but do not load yet (%s): keeping the previous ones",
                    self._name,
                    exc,
                )
                return self._context
            self._stamp = stamp
            self._context = context
            self.reloads += 1
            log.info("%s certificate reloaded from %s", self._name, ", ".join(self.files.paths()))
            return context


TLS_SHUTDOWN_SECONDS = 1.0
"""How long closing a TLS connection waits for the peer's close_notify (asyncio: 30 s)."""


class TlsChannel(LiveChannel):
    """A grpclib channel whose every new connection uses the current context of ``tls``.

    grpclib keeps one ``ssl`` for the channel's life; a reconnect after a rotation must
    present the new certificate, so the context is looked up at each connect.
    """

    def __init__(self, target: HostPort, tls: ReloadingContext, config: Configuration) -> None:
        # A bare placeholder (reads no file) makes grpclib speak https; every connect
        # replaces it with the current context.
        super().__init__(
            target.host, target.port, ssl=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), config=config
        )
        self._tls = tls

    def _tls_files(self) -> TlsFiles:
        return self._tls.files

    def _set_problem(self, exc: BaseException | None) -> None:
        """Keep why the server ended the connection; a refusal that asks for a client
        certificate is final only when none is configured (no rotation can add one)."""
        problem = diagnose(exc, self.address, self._tls.files) if exc is not None else None
        if problem is None:
            problem = refused_after_handshake(self.address, self._tls.files)
        problem.final = problem.final and self._tls.files.cert is None
        self.problem = problem

    async def _connect(self) -> H2Protocol:
        self._ssl = await self._tls.current()
        try:
            # As grpclib's own, plus a short TLS shutdown: a connection closed because its
            # peer stopped answering pings (paused, partitioned) would otherwise wait
            # asyncio's 30 s for the peer's close_notify before its streams hear of it, and a
            # waiting Acquire would sit on a dead replica that long.
            _, protocol = await self._loop.create_connection(
                self._protocol_factory,
                self._host,
                self._port,
                ssl=self._ssl,
                server_hostname=self._config.ssl_target_name_override,
                ssl_shutdown_timeout=TLS_SHUTDOWN_SECONDS,
            )
        except ssl.SSLError as exc:
            problem = diagnose(exc, self.address, self._tls.files)
            if problem is not None:
                problem.final = problem.final and self._tls.files.cert is None
                raise problem from exc
            raise
        return protocol

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        self._watch_refusal(protocol)
        return protocol

    def _watch_refusal(self, protocol: H2Protocol) -> None:
        """Name a refusal of our certificate, which grpclib reports as "connection lost".

        With TLS 1.3 the server checks our certificate after our side of the handshake is
        done, and its refusal ends the connection before the server sent a single HTTP/2
        byte (a server that accepted us sends its SETTINGS at once). It may end it with an
        alert, a reset, or a bare end of stream, which asyncio's TLS would otherwise wait on
        for its shutdown timeout (30 s) before grpclib hears of it: cut it short.
        """
        made = protocol.connection_made
        received = protocol.data_received
        lost = protocol.connection_lost
        heard = False
        transport: asyncio.BaseTransport | None = None

        def connection_made(tr: asyncio.BaseTransport) -> None:
            nonlocal transport
            transport = tr
            made(tr)

        def data_received(data: bytes) -> None:
            nonlocal heard
            heard = True
            received(data)

        def eof_received() -> bool | None:
            if not heard:
                self._set_problem(None)
                if isinstance(transport, asyncio.Transport):
                    transport.abort()  # connection_lost follows: grpclib fails the calls
            return None

        def connection_lost(exc: BaseException | None) -> None:
            # The server's alert (TLS 1.3: CERTIFICATE_REQUIRED, UNKNOWN_CA, ...) surfaces
            # here, on the first read after our handshake, as an SSLError.
            if isinstance(exc, ssl.SSLError):
                self._set_problem(exc)
            elif not heard and self.problem is None:
                self._set_problem(None)
            lost(exc)

        protocol.connection_made = connection_made  # type: ignore[method-assign,assignment]
        protocol.data_received = data_received  # type: ignore[method-assign]
        protocol.eof_received = eof_received  # type: ignore[method-assign]
        protocol.connection_lost = connection_lost  # type: ignore[method-assign]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def client_tls_from_env(
    *,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    insecure: bool | None = None,
    all_unix: bool = False,
) -> TlsFiles | None:
    """The client's TLS files, or None for an explicitly chosen plaintext.

    Order: ``insecure=True``; files given as arguments; files from the environment;
    ``$TIMESLICE_INSECURE``; unix targets only (``all_unix``). Anything else is refused:
    plaintext over a network is never the silent default.
    """
    if insecure:
        return None
    ca = ca or os.environ.get(CA_ENV) or None
    cert = cert or os.environ.get(CERT_ENV) or None
    key = key or os.environ.get(KEY_ENV) or None
    if ca is not None:
        return TlsFiles(ca, cert, key)
    if cert is not None or key is not None:
        raise InvalidArgument(f"a client certificate needs the CA too (tls_ca= or ${CA_ENV})")
    if insecure is None and (_env_flag(INSECURE_ENV) or all_unix):
        return None
    raise InvalidArgument(
        f"no TLS configured: pass tls_ca= (and tls_cert=, tls_key=) or set ${CA_ENV} "
        f"(${CERT_ENV}, ${KEY_ENV}); for plaintext pass insecure=True or set ${INSECURE_ENV}=1"
    )


def client_tls(
    targets: Sequence[Target],
    *,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    insecure: bool | None = None,
) -> ReloadingContext | None:
    """The TLS context of a client of ``targets`` (None: plaintext, chosen explicitly).

    See :func:`client_tls_from_env` for the order. The files are only opened here (a
    missing or unreadable one raises :class:`~timeslice.errors.CertificateFileError`, naming
    it); the first connection reads them.
    """
    all_unix = bool(targets) and all(isinstance(t, UnixSocket) for t in targets)
    files = client_tls_from_env(ca=ca, cert=cert, key=key, insecure=insecure, all_unix=all_unix)
    if files is None:
        return None
    # A mistyped path fails here, naming it, not at the first call as an outage.
    files.check_readable()
    return ReloadingContext(files, client_context, name="orchestrator TLS")
