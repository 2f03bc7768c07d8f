"""Who may act through the client API: session secrets and the operator identity.

Sessions: OpenSession returns a random secret once; every call that acts on the session
(KeepAlive, CloseSession, Acquire, Yield) must present it. etcd keeps only its SHA-256 (a
reader of etcd or of a backup cannot act with what it finds), and the comparison takes
constant time. A plain hash is enough: the secret is 256 random bits, not a password, so there
is nothing to guess that a slow hash would protect.

Operators: the RPCs that change a group for everyone (``SetGroupMembers``, and the operator
Yield, which names no session) need an operator identity. Today that is a bearer token from a
file (``--operator-token-file``) sent as gRPC metadata ``authorization: Bearer <token>``.
:meth:`Authorizer.is_operator` is the one place that decides; a certificate-based operator role
(mutual TLS) belongs there too, next to the token check. With neither configured, nobody is an
operator: operator RPCs are refused rather than open to anyone.

Every refusal (a wrong session secret, an operator RPC from a non-operator) is counted in
``timeslice_authz_refusals_total`` and logged once per distinct (RPC, cause), so that a caller
retrying in a loop cannot flood the log.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from pathlib import Path
from typing import Any

import grpclib.server

from timeslice.errors import InvalidArgument
from timeslice_orchestrator import identity
from timeslice_orchestrator.metrics import Metrics

log = logging.getLogger(__name__)

SECRET_BYTES = 32
"""Random bytes in a session secret (256 bits; the issue asks for at least 128)."""
# A secret longer than this is refused before it is hashed: ours are 43 characters.
_MAX_SECRET_CHARS = 256
# Distinct (RPC, cause) pairs logged at most; beyond that refusals are only counted.
_LOGGED_KEPT = 256
_BEARER = "bearer "


def new_session_secret() -> str:
    """A fresh session secret (URL-safe text, :data:`SECRET_BYTES` random bytes)."""
    return secrets.token_urlsafe(SECRET_BYTES)


def secret_hash(secret: str) -> str:
    """What etcd keeps of a session secret: its SHA-256, in hex."""
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    """Whether ``secret`` is the one ``stored_hash`` was made from (constant time).

    A session without a stored hash (written before secrets existed) matches nothing: such a
    session cannot be used, and its client opens a new one once it expires.
    """
    if not secret or not stored_hash or len(secret) > _MAX_SECRET_CHARS:
        return False
    return hmac.compare_digest(secret_hash(secret), stored_hash)


def load_operator_token(path: str) -> str:
    """The operator token in ``path`` (surrounding whitespace ignored); it must not be empty."""
    token = Path(path).read_text(encoding="utf-8").strip()
    if len(token) < 16:
        # A short token can be guessed; refuse to start rather than protect nothing.
        raise InvalidArgument(f"operator token in {path} is shorter than 16 characters")
    return token


class Authorizer:
    """Decides who is an operator, and counts and logs every refusal of the client API."""

    def __init__(self, metrics: Metrics, operator_token: str | None = None) -> None:
        self._metrics = metrics
        self._token = operator_token.encode() if operator_token else None
        self._logged: set[tuple[str, str]] = set()

    @property
    def has_operator_identity(self) -> bool:
        """Whether an operator token is configured (else only operator certificates are)."""
        return self._token is not None

    def is_operator(self, stream: grpclib.server.Stream[Any, Any]) -> bool:
        """Whether the caller of ``stream`` is an operator.

        The one place for every kind of operator identity: a client certificate with the
        operator role (mutual TLS, :mod:`.identity`), or the bearer token.
        """
        who = identity.current()
        if who is not None and who.operator:
            return True
        return self._token_matches(stream)

    def _token_matches(self, stream: grpclib.server.Stream[Any, Any]) -> bool:
        if self._token is None:
            return False
        values = stream.metadata.getall("authorization", []) if stream.metadata else []
        for value in values:
            text = value if isinstance(value, str) else value.decode(errors="replace")
            if text[: len(_BEARER)].lower() == _BEARER:
                presented = text[len(_BEARER) :].strip().encode()
                if hmac.compare_digest(presented, self._token):
                    return True
        return False

    def refused(self, rpc: str, cause: str, peer: str = "") -> None:
        """Count one refusal; log it the first time this (``rpc``, ``cause``) is seen."""
        self._metrics.authz_refusals.labels(rpc=rpc, cause=cause).inc()
        key = (rpc, cause)
        if key in self._logged:
            return
        if len(self._logged) >= _LOGGED_KEPT:
            return  # still counted; the log already says plenty
        self._logged.add(key)
        source = f" from {peer}" if peer else ""
        log.warning(
            "refused %s%s: %s (logged once; timeslice_authz_refusals_total counts every one)",
            rpc,
            source,
            cause,
        )


def peer_of(stream: grpclib.server.Stream[Any, Any]) -> str:
    """The caller's address, for the log (empty when unknown)."""
    try:
        address = stream.peer.addr()
    except Exception:  # a closed transport: the log line just goes without it
        return ""
    if address is None:
        return ""
    if isinstance(address, tuple) and len(address) >= 2:
        return f"{address[0]}:{address[1]}"
    return str(address)
