"""Who is calling: identities from client certificates, and the checks handlers make.

With mutual TLS every connection carries a verified client certificate. It says one of:

- an operator: SAN URI ``timeslice://operator``, or (only when ``--tls-operator-ou`` names
  one; off by default) a subject OU; an operator may call the operator RPCs and act as any
  job;
- a node (an agent): SAN URI ``timeslice://node/<name>``; only that node's agent stream;
- a job: by default SAN URI ``timeslice://job/<id>``; with ``--tls-job-identity dns`` the
  first DNS SAN, with ``cn`` the subject CN. A job's certificate acts as that job only.

A certificate whose CN, job or node is a reserved name (an etcd user: ``root``,
``timeslice`` and ``--tls-reserved-names``) is refused every call (PERMISSION_DENIED): such a
certificate is either the etcd CA's, which the replicas do not trust, or one that could act as
that user in an etcd that trusts the same CA (docs/security.md).

Without TLS (``--insecure``) there is no identity (``None``) and these checks let the call
through: what protects a plaintext deployment is elsewhere (session secrets, the operator
token). The handlers ask :func:`current` (set for each request by :func:`install`), or
:func:`peer_identity` of a grpclib stream.
"""

from __future__ import annotations

import contextvars
import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from grpclib.events import RecvRequest, listen
from grpclib.server import Server, Stream

from timeslice.errors import PermissionDenied

log = logging.getLogger(__name__)

OPERATOR_URI = "timeslice://operator"
NODE_URI = "timeslice://node/"
JOB_URI = "timeslice://job/"
# etcd's users (etcd takes a client certificate's CN for its user): always reserved.
RESERVED_NAMES: frozenset[str] = frozenset({"root", "timeslice"})
# Distinct refused subjects logged at most (a flood of them is only refused, not logged).
_MAX_LOGGED = 256


class JobSource(enum.Enum):
    """Where a job's certificate names the job (``--tls-job-identity``)."""

    URI = "uri"
    DNS = "dns"
    CN = "cn"


@dataclass(frozen=True, slots=True)
class IdentityRules:
    job_source: JobSource = JobSource.URI
    operator_ou: str = ""
    """A subject OU that makes a certificate an operator; empty (the default): none does."""
    reserved: frozenset[str] = RESERVED_NAMES
    """Names no client certificate may carry as CN, job or node (etcd users)."""


@dataclass(frozen=True, slots=True)
class Identity:
    """What a verified client certificate allows."""

    subject: str
    """The certificate's subject CN, for logs."""
    job: str | None = None
    node: str | None = None
    operator: bool = False
    reserved: str | None = None
    """The reserved name (an etcd user) the certificate carries: it may do nothing."""

    def may_act_as_job(self, job: str) -> bool:
        return self.operator or self.job == job

    def __str__(self) -> str:
        roles = [f"job {self.job}"] if self.job else []
        roles += [f"node {self.node}"] if self.node else []
        roles += ["operator"] if self.operator else []
        if self.reserved is not None:
            roles = [f"reserved name {self.reserved!r}"]
        return f"{self.subject!r} ({', '.join(roles) or 'no timeslice role'})"


def identity_of(cert: Mapping[str, Any] | None, rules: IdentityRules) -> Identity | None:
    """The identity a verified certificate (``ssl.getpeercert()``'s dict) grants."""
    if not cert:
        return None
    subject: dict[str, str] = {}
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            subject.setdefault(key, value)
    sans: list[tuple[str, str]] = list(cert.get("subjectAltName", ()))
    uris = [v for k, v in sans if k == "URI"]
    dns = [v for k, v in sans if k == "DNS"]
    cn = subject.get("commonName", "")
    operator = OPERATOR_URI in uris or (
        bool(rules.operator_ou) and subject.get("organizationalUnitName") == rules.operator_ou
    )
    node = next((u[len(NODE_URI) :] for u in uris if u.startswith(NODE_URI)), None)
    job: str | None
    if rules.job_source is JobSource.URI:
        job = next((u[len(JOB_URI) :] for u in uris if u.startswith(JOB_URI)), None)
    elif rules.job_source is JobSource.DNS:
        job = dns[0] if dns else None
    else:
        job = cn or None
    if operator or node is not None:
        # A role certificate is not also a job's (a CN-named job would otherwise be any CN).
        job = job if rules.job_source is JobSource.URI else None
    taken = next((n for n in (cn, job, node) if n and n in rules.reserved), None)
    if taken is not None:
        return Identity(subject=cn, reserved=taken)
    return Identity(subject=cn, job=job or None, node=node or None, operator=operator)


def peer_identity(stream: Stream[Any, Any], rules: IdentityRules) -> Identity | None:
    """The identity of the client of ``stream`` (None: plaintext, no certificate)."""
    return identity_of(stream.peer.cert(), rules)


_current: contextvars.ContextVar[Identity | None] = contextvars.ContextVar(
    "timeslice_identity", default=None
)


def current() -> Identity | None:
    """The identity of the request being handled (None without TLS)."""
    return _current.get()


def install(server: Server, rules: IdentityRules) -> None:
    """Make :func:`current` answer for every request ``server`` handles.

    grpclib dispatches RecvRequest in the task that then runs the handler, so the variable
    set here is what the handler sees.
    """

    logged: set[str] = set()

    async def on_request(event: RecvRequest) -> None:
        who = identity_of(event.peer.cert(), rules)
        _current.set(who)
        if who is not None and who.reserved is not None:
            if who.subject not in logged and len(logged) < _MAX_LOGGED:
                logged.add(who.subject)
                log.warning(
                    "refused every call of the client certificate %s: %r is an etcd user "
                    "(reserved names: %s); logged once per subject",
                    who,
                    who.reserved,
                    ", ".join(sorted(rules.reserved)),
                )
            raise PermissionDenied(
                f"the client certificate {who} names an etcd user ({who.reserved!r}); "
                "reserved names may not be jobs, nodes or clients"
            ).to_grpc()

    listen(server, RecvRequest, on_request)


def check_job(job: str, what: str) -> None:
    """Refuse ``what`` for ``job`` unless the caller's certificate may act as that job.

    Raises :class:`PermissionDenied` (PERMISSION_DENIED on the wire; the handler counts it).
    """
    who = current()
    if who is None or who.may_act_as_job(job):
        return
    log.warning("%s as job %r refused: the certificate is %s", what, job, who)
    raise PermissionDenied(f"{what}: the client certificate {who} may not act as job {job!r}")


def check_node(node: str) -> None:
    """Refuse an agent stream for ``node`` unless the certificate is that node's."""
    who = current()
    if who is None or who.node == node:
        return
    log.warning("agent stream for node %r refused: the certificate is %s", node, who)
    raise PermissionDenied(f"the client certificate {who} is not node {node!r}'s")
