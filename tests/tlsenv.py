"""TLS for the tests' own raw clients (bare grpclib channels and etcd clients), chosen as the
SDK chooses it: the session's ``$TIMESLICE_TLS_*`` files (tests/conftest.py), or plaintext
where a test chose it."""

from __future__ import annotations

import functools
import ssl

from timeslice.tls import TlsFiles, client_context, client_tls_from_env

__all__ = ["env_context"]


def env_context() -> ssl.SSLContext | None:
    """The client context the environment asks for; None: plaintext, chosen explicitly."""
    files = client_tls_from_env()
    return None if files is None else _context(files)


@functools.cache
def _context(files: TlsFiles) -> ssl.SSLContext:
    # The session's files never change: read them once per process.
    return client_context(files)
