"""Why a connection failed, typed and told in words a user can act on.

asyncio and OpenSSL report a failed connect in their own terms (``[Errno 111] Connect call
failed``, ``WRONG_VERSION_NUMBER``, ``CERTIFICATE_VERIFY_FAILED``), and grpclib reports a
server that hung up on a plaintext client as "Connection lost". :func:`diagnose` turns what
the channel saw into one of the :class:`~timeslice.errors.ConnectionFailed` classes, whose
message names the address, the cause and what to do. Reading OpenSSL's reason strings here is
reading an outside tool's report (they are not our wire format).
"""

from __future__ import annotations

import datetime
import logging
import socket
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING

from timeslice.errors import (
    CertificateExpired,
    ConnectionFailed,
    ConnectionRefused,
    NameNotResolved,
    ServerRequiresTls,
    ServerWithoutTls,
    TlsRefused,
    UntrustedCertificate,
)

if TYPE_CHECKING:
    from timeslice.tls import TlsFiles

# The variables a user sets (as timeslice.tls reads them). Not imported from there:
# timeslice.tls builds its channel on timeslice._channel, which uses this module.
CA_ENV = "TIMESLICE_TLS_CA"
CERT_ENV = "TIMESLICE_TLS_CERT"
KEY_ENV = "TIMESLICE_TLS_KEY"
INSECURE_ENV = "TIMESLICE_INSECURE"

__all__ = [
    "describe_tls_error",
    "diagnose",
    "hung_up_before_answering",
    "refused_after_handshake",
    "requires_certificate",
]

log = logging.getLogger("timeslice.transport")

# OpenSSL's X509_V_ERR_* codes (ssl.SSLCertVerificationError.verify_code).
_NOT_YET_VALID = 9
_EXPIRED = 10
_HOSTNAME_MISMATCH = 62


def _reason(exc: ssl.SSLError) -> str:
    return (exc.reason or str(exc)).lower()


def _detail(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        return exc.verify_message
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return exc.reason
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


def diagnose(exc: BaseException, address: str, tls: TlsFiles | None) -> ConnectionFailed | None:
    """The typed cause of a failed connect to ``address`` (``host:port`` or ``unix:path``);
    ``tls``: the files this client connects with (``None``: plaintext). ``None`` when the
    failure is none of the known causes (the caller reports it as it is)."""
    if isinstance(exc, ConnectionFailed):
        return exc
    if isinstance(exc, ssl.SSLError):
        return _tls(exc, address, tls)
    if isinstance(exc, socket.gaierror):
        host = address.rpartition(":")[0].strip("[]") or address
        return NameNotResolved(
            f"the host name {host!r} of {address} does not resolve: check the address "
            f"(a typo? a name known only inside another network?) ({_detail(exc)})"
        )
    if isinstance(exc, ConnectionRefusedError) or (
        address.startswith("unix:") and isinstance(exc, FileNotFoundError)
    ):
        why = "connection refused" if isinstance(exc, ConnectionRefusedError) else "no such socket"
        return ConnectionRefused(
            f"nothing listens on {address}: is the orchestrator running, and at this "
            f"address? ({why})"
        )
    if isinstance(exc, ConnectionResetError | ConnectionAbortedError) and tls is not None:
        return TlsRefused(
            f"{address} reset the connection during the TLS handshake: the server may not "
            f"speak TLS, or it refused the connection ({_detail(exc)})"
        )
    return None


def hung_up_before_answering(address: str) -> ServerRequiresTls:
    """A plaintext connection the server closed before sending a byte: a gRPC server sends
    its HTTP/2 settings at once; a TLS server waits for a TLS hello and hangs up on ours."""
    return ServerRequiresTls(
        f"{address} closed the connection without answering, as a TLS server does to a "
        f"plaintext client: connect with TLS (tls_ca=, or ${CA_ENV}; with tls_cert= and "
        f"tls_key=, or ${CERT_ENV} and ${KEY_ENV}, for mutual TLS) instead of "
        f"insecure=True / ${INSECURE_ENV}"
    )


def refused_after_handshake(address: str, files: TlsFiles) -> TlsRefused:
    """The server hung up right after the TLS handshake (TLS 1.3 checks our certificate
    then), without an alert that says why: look at our own certificate to say it."""
    if files.cert is None:
        return TlsRefused(
            f"{address} closed the connection right after the TLS handshake: it requires a "
            f"client certificate and none is configured (tls_cert= and tls_key=, or "
            f"${CERT_ENV} and ${KEY_ENV})",
            final=True,
        )
    refused = f"{address} refused our client certificate {files.cert}"
    problem = _own_certificate_problem(files.cert, files.ca)
    if problem is not None and problem.valid is not None:
        start, end = problem.valid
        if end < datetime.datetime.now(datetime.UTC):
            return CertificateExpired(
                f"{refused}: it expired on {end:%Y-%m-%d %H:%M} UTC; renew it (and its key)"
            )
        return CertificateExpired(
            f"{refused}: it is not valid before {start:%Y-%m-%d %H:%M} UTC: check the clocks "
            "of this host and the server"
        )
    if problem is not None and problem.issuer is not None:
        return UntrustedCertificate(
            f"{refused}: it is signed by {problem.issuer}, not by the CA in {files.ca} that "
            "this deployment uses; use a certificate from that CA"
        )
    return TlsRefused(
        f"{refused} right after the TLS handshake (signed by a CA it does not trust, "
        "expired, or not yet valid)"
    )


@dataclass(frozen=True, slots=True)
class _OwnProblem:
    valid: tuple[datetime.datetime, datetime.datetime] | None = None
    """The certificate's validity, when now is outside it."""
    issuer: str | None = None
    """Who signed it, when no certificate in the CA file did."""


def _own_certificate_problem(cert: str, ca: str) -> _OwnProblem | None:
    """Why a server may refuse ``cert``, or ``None`` (also when it cannot tell: the SDK alone
    does not ship ``cryptography``). A few KB read from local files, only after a refusal."""
    try:
        from cryptography import x509
        from cryptography.exceptions import InvalidSignature
    except ImportError:
        return None
    try:
        with open(cert, "rb") as f:
            chain = x509.load_pem_x509_certificates(f.read())
        with open(ca, "rb") as f:
            authorities = x509.load_pem_x509_certificates(f.read())
    except (OSError, ValueError) as exc:
        log.debug("could not read %s or %s to say why it was refused: %s", cert, ca, exc)
        return None
    ours = chain[0]
    now = datetime.datetime.now(datetime.UTC)
    if not ours.not_valid_before_utc <= now <= ours.not_valid_after_utc:
        return _OwnProblem(valid=(ours.not_valid_before_utc, ours.not_valid_after_utc))

    def signed_by_one_of(child: x509.Certificate, issuers: list[x509.Certificate]) -> bool:
        # By signature, not by name: two dev CAs may well share a name.
        for issuer in issuers:
            try:
                child.verify_directly_issued_by(issuer)
            except (ValueError, TypeError, InvalidSignature):
                continue
            return True
        return False

    # Our file may carry intermediates: ours signed by one that the CA signed also counts.
    trusted = authorities + [c for c in chain[1:] if signed_by_one_of(c, authorities)]
    if not signed_by_one_of(ours, trusted):
        name = ours.issuer.rfc4514_string()
        if any(a.subject == ours.issuer for a in authorities):
            name = f"another CA, also named {name}"
        return _OwnProblem(issuer=name)
    return None


def _tls(exc: ssl.SSLError, address: str, tls: TlsFiles | None) -> ConnectionFailed:
    reason = _reason(exc)
    detail = _detail(exc)
    ca = tls.ca if tls is not None else "the configured CA"
    cert = tls.cert if tls is not None and tls.cert is not None else None
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        if code == _EXPIRED:
            return CertificateExpired(
                f"the certificate of the server at {address} has expired: renew it on the "
                f"server ({detail})"
            )
        if code == _NOT_YET_VALID:
            return CertificateExpired(
                f"the certificate of the server at {address} is not valid yet: check the "
                f"clocks of this host and the server ({detail})"
            )
        if code == _HOSTNAME_MISMATCH:
            return UntrustedCertificate(
                f"the certificate of the server at {address} does not name that host: "
                f"connect by a name or address its certificate lists ({detail})"
            )
        return UntrustedCertificate(
            f"the certificate of the server at {address} is not signed by the CA in {ca}: "
            f"is that the CA of this deployment (tls_ca=, ${CA_ENV})? ({detail})"
        )
    if "wrong_version" in reason or "record_layer" in reason or "packet_length" in reason:
        return ServerWithoutTls(
            f"{address} does not speak TLS (a server started with --insecure?): connect "
            f"with insecure=True or ${INSECURE_ENV}=1 if it is meant to be plaintext, or "
            f"give the server a certificate ({detail})"
        )
    if "unknown_ca" in reason or "unknown ca" in reason:
        return UntrustedCertificate(
            f"the server at {address} does not trust our client certificate "
            f"{cert or ''}: it is signed by a CA the server does not know; use a "
            f"certificate from this deployment's CA ({detail})".replace("  ", " ")
        )
    if "expired" in reason:
        return CertificateExpired(
            f"the server at {address} refused our client certificate {cert or ''}: it has "
            f"expired; renew it ({detail})".replace("  ", " ")
        )
    return TlsRefused(f"{address}: {describe_tls_error(exc)}", final=requires_certificate(exc))


def requires_certificate(exc: ssl.SSLError) -> bool:
    """The server's alert says it requires a client certificate (TLS 1.3's
    ``TLSV13_ALERT_CERTIFICATE_REQUIRED``; ``CERTIFICATE_REQUIRED`` elsewhere)."""
    reason = (exc.reason or str(exc)).lower()
    return "certificate_required" in reason or "certificate required" in reason


def describe_tls_error(exc: ssl.SSLError) -> str:
    """A sentence for a TLS failure, naming the likely cause."""
    reason = (exc.reason or str(exc)).lower()
    if requires_certificate(exc):
        why = (
            "the server requires a client certificate and none was sent (configure one: "
            f"tls_cert= and tls_key=, or ${CERT_ENV} and ${KEY_ENV})"
        )
    elif "unknown_ca" in reason or "unknown ca" in reason:
        why = "the server does not trust the CA that signed our certificate"
    elif "expired" in reason:
        why = "a certificate has expired"
    elif "bad_certificate" in reason or "bad certificate" in reason:
        why = "the server refused our certificate"
    elif "certificate_verify_failed" in reason or "verify failed" in reason:
        why = "the server's certificate did not verify against our CA"
    elif "wrong_version" in reason or "record_layer" in reason or "packet_length" in reason:
        why = "the server does not speak TLS (started with --insecure?)"
    else:
        why = "the TLS handshake failed"
    detail = getattr(exc, "verify_message", None) or exc.reason or str(exc)
    return f"TLS error: {why} ({detail})"
