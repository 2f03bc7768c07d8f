"""A throw-away certificate authority and the certificates of a timeslice deployment.

``timeslice dev cluster --tls``, the demo, the tests and ``timeslice dev certs --out DIR``
(the documented way to make the Secrets of the Compose and Kubernetes deployments) all use
this one module, so every component's certificate carries what the others check:

==========================  ==============================================================
file                        what it is
==========================  ==============================================================
``ca.crt`` / ``ca.key``     the CA of the gRPC hops: replicas and agents trust it (keep
                            ``ca.key`` away from services); etcd does *not*
``etcd-ca.crt`` / ``.key``  the etcd CA: the only CA etcd trusts (clients and peers) and
                            the one the replicas verify etcd against
``orchestrator.*``          replicas' server certificate (DNS ``localhost`` and the names
                            given, IP 127.0.0.1 and ::1)
``etcd-server.*``           etcd's server certificate (etcd CA)
``etcd-client.*``           the replicas' certificate towards etcd (etcd CA): its CN is the
                            etcd user (``timeslice``) whose role reaches only the key prefix
``etcd-root.*``             etcd's ``root`` (etcd CA; sets up auth; tests that compact)
``operator.*``              an operator: SAN URI ``timeslice://operator``; may act as any job
``node-<name>.*``           an agent: SAN URI ``timeslice://node/<name>``, CN ``<name>``
``job-<id>.*``              a job: SAN URI ``timeslice://job/<id>``, CN ``<id>``
==========================  ==============================================================

etcd maps a client certificate's CN to its user. Two controls keep a job or node from being
an etcd user: etcd trusts only the etcd CA, which signs nothing but the three etcd
certificates; and the CA of the gRPC hops refuses to sign a certificate whose CN, job or node
names a reserved etcd user (:data:`RESERVED_NAMES`; :class:`ReservedName`). A directory made
before the etcd CA existed (one CA for everything) is upgraded with :meth:`Pki.split_etcd_ca`
(``timeslice dev certs --out DIR --split-etcd-ca``).

Keys are ECDSA P-256, written with mode 0600. Every file is written to a temporary name and
renamed into place, so a reader never sees half a certificate (rotation tests rely on it).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "ETCD_ROOT",
    "ETCD_USER",
    "OPERATOR_URI",
    "RESERVED_NAMES",
    "CertPair",
    "Pki",
    "ReservedName",
    "job_uri",
    "node_uri",
    "reserved_name",
]

OPERATOR_URI = "timeslice://operator"
ETCD_USER = "timeslice"
ETCD_ROOT = "root"
# etcd users: no certificate of the gRPC hops' CA may carry one as its CN, job or node.
RESERVED_NAMES: frozenset[str] = frozenset({ETCD_ROOT, ETCD_USER})
DEFAULT_DAYS = 365
# The certificates the etcd CA signs (and the only ones it signs).
_ETCD_CERTS = ("etcd-server", "etcd-client", "etcd-root")
_NODE_PREFIX = "timeslice://node/"
_JOB_PREFIX = "timeslice://job/"


class ReservedName(ValueError):
    """A certificate of the gRPC hops' CA would name an etcd user (``root``, ``timeslice``)."""


def reserved_name(
    common_name: str, uris: Sequence[str] = (), reserved: frozenset[str] = RESERVED_NAMES
) -> str | None:
    """The reserved name a certificate with this CN and these SAN URIs would carry, if any:
    its CN, or the job or node its URIs name."""
    names = [common_name]
    for uri in uris:
        for prefix in (_NODE_PREFIX, _JOB_PREFIX):
            if uri.startswith(prefix):
                names.append(uri[len(prefix) :])
    return next((n for n in names if n in reserved), None)


def node_uri(node: str) -> str:
    return f"timeslice://node/{node}"


def job_uri(job: str) -> str:
    return f"timeslice://job/{job}"


@dataclass(frozen=True, slots=True)
class CertPair:
    """A certificate and its key, as files."""

    cert: Path
    key: Path


def _write(path: Path, data: bytes, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class Pki:
    """The certificates of one deployment, as files in ``directory``.

    :meth:`create` makes the two CAs and the service certificates; :meth:`node`, :meth:`job`
    and :meth:`issue` add more at any time (etcd's from the etcd CA, the rest from ``ca.crt``).
    """

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)

    @property
    def ca(self) -> Path:
        """The CA of the gRPC hops (replicas, agents, jobs, operators)."""
        return self.directory / "ca.crt"

    @property
    def etcd_ca(self) -> Path:
        """The etcd CA: what etcd trusts (``--trusted-ca-file``) and what its clients verify
        etcd's server certificate against (``--etcd-ca``)."""
        return self.directory / "etcd-ca.crt"

    def pair(self, name: str) -> CertPair:
        return CertPair(self.directory / f"{name}.crt", self.directory / f"{name}.key")

    @property
    def orchestrator(self) -> CertPair:
        return self.pair("orchestrator")

    @property
    def etcd_server(self) -> CertPair:
        return self.pair("etcd-server")

    @property
    def etcd_client(self) -> CertPair:
        return self.pair("etcd-client")

    @property
    def etcd_root(self) -> CertPair:
        return self.pair("etcd-root")

    @property
    def operator(self) -> CertPair:
        return self.pair("operator")

    @classmethod
    def create(
        cls,
        directory: Path | str,
        *,
        nodes: Sequence[str] = (),
        jobs: Sequence[str] = (),
        hosts: Sequence[str] = (),
        days: int = DEFAULT_DAYS,
    ) -> Pki:
        """A new CA in ``directory`` and every service certificate.

        ``hosts``: DNS names or IP addresses the orchestrator and etcd answer on, besides
        ``localhost``, 127.0.0.1 and ::1 (Kubernetes Service names, say).
        """
        pki = cls(directory)
        pki.directory.mkdir(parents=True, exist_ok=True)
        pki._new_ca("ca", "timeslice dev CA", days)
        pki._new_ca("etcd-ca", "timeslice dev etcd CA", days)
        names = ["localhost", "127.0.0.1", "::1", *hosts]
        pki.issue("orchestrator", common_name="timeslice-orchestrator", hosts=names, days=days)
        pki._issue_etcd_certs(names, days)
        pki.issue("operator", common_name="operator", uris=[OPERATOR_URI], client=True, days=days)
        for node in nodes:
            pki.node(node, days=days)
        for job in jobs:
            pki.job(job, days=days)
        return pki

    def _new_ca(self, name: str, common_name: str, days: float) -> None:
        """A self-signed CA, files ``name.crt`` and ``name.key``."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        start = _now() - datetime.timedelta(minutes=5)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        _write(self.directory / f"{name}.key", _key_pem(key), 0o600)
        _write(self.directory / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM), 0o644)

    def _issue_etcd_certs(self, hosts: Sequence[str], days: float) -> None:
        self.issue("etcd-server", common_name="etcd", hosts=hosts, days=days)
        self.issue("etcd-client", common_name=ETCD_USER, client=True, days=days)
        self.issue("etcd-root", common_name=ETCD_ROOT, client=True, days=days)

    def split_etcd_ca(self, *, days: float = DEFAULT_DAYS) -> bool:
        """Give a directory made with one CA for everything its own etcd CA (the migration).

        Makes ``etcd-ca.crt``/``.key`` and re-issues ``etcd-server`` (same host names),
        ``etcd-client`` and ``etcd-root`` from it; the gRPC hops' CA and every other
        certificate stay. etcd must then be restarted trusting ``etcd-ca.crt`` only, and the
        replicas given ``--etcd-ca etcd-ca.crt``. False (nothing done) if it already has one.
        """
        if self.etcd_ca.exists():
            return False
        hosts: list[str] = []
        server = self.etcd_server.cert
        if server.exists():
            cert = x509.load_pem_x509_certificate(server.read_bytes())
            try:
                sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            except x509.ExtensionNotFound:
                sans = x509.SubjectAlternativeName([])
            hosts = [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
            hosts = sans.get_values_for_type(x509.DNSName) + hosts
        self._new_ca("etcd-ca", "timeslice dev etcd CA", days)
        self._issue_etcd_certs(hosts or ["localhost", "127.0.0.1", "::1"], days)
        return True

    def node(self, node: str, *, days: int = DEFAULT_DAYS) -> CertPair:
        """The agent certificate of ``node`` (made if missing)."""
        pair = self.pair(f"node-{node}")
        if not pair.cert.exists():
            self.issue(f"node-{node}", common_name=node, uris=[node_uri(node)], days=days)
        return pair

    def job(self, job: str, *, days: int = DEFAULT_DAYS) -> CertPair:
        """A client certificate that may act as job ``job`` only (made if missing)."""
        pair = self.pair(f"job-{job}")
        if not pair.cert.exists():
            self.issue(f"job-{job}", common_name=job, uris=[job_uri(job)], days=days)
        return pair

    def issue(
        self,
        name: str,
        *,
        common_name: str,
        hosts: Sequence[str] = (),
        uris: Sequence[str] = (),
        dns: Sequence[str] = (),
        organizational_unit: str | None = None,
        client: bool = True,
        days: float = DEFAULT_DAYS,
        not_before: datetime.datetime | None = None,
    ) -> CertPair:
        """Sign a certificate for ``name`` (files ``name.crt``, ``name.key``); replaces them.

        ``hosts`` make it a server certificate too (DNS names and IP addresses); ``uris`` and
        ``dns`` are extra subject alternative names (identities); a negative ``days`` with an
        earlier ``not_before`` makes an expired one (tests).

        ``etcd-server``, ``etcd-client`` and ``etcd-root`` are signed by the etcd CA, every
        other name by the gRPC hops' CA, which refuses (:class:`ReservedName`) a CN, job or
        node that names an etcd user: etcd would take such a certificate for that user if it
        ever trusted this CA.
        """
        authority = "etcd-ca" if name in _ETCD_CERTS else "ca"
        if authority == "ca":
            taken = reserved_name(common_name, uris)
            if taken is not None:
                raise ReservedName(
                    f"refusing to issue {name!r}: {taken!r} is an etcd user "
                    f"(reserved: {', '.join(sorted(RESERVED_NAMES))}); a job, node or "
                    "client certificate that carries it could act as that user in etcd. "
                    "Choose another name."
                )
        ca_key = serialization.load_pem_private_key(
            (self.directory / f"{authority}.key").read_bytes(), password=None
        )
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        ca_cert = x509.load_pem_x509_certificate((self.directory / f"{authority}.crt").read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        if organizational_unit is not None:
            attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, organizational_unit))
        sans: list[x509.GeneralName] = []
        for host in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                sans.append(x509.DNSName(host))
        sans += [x509.DNSName(d) for d in dns]
        sans += [x509.UniformResourceIdentifier(u) for u in uris]
        usages = []
        if hosts:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        start = not_before or (_now() - datetime.timedelta(minutes=5))
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(start + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        pair = self.pair(name)
        # The key first: a reader that sees the new certificate finds its key already there.
        _write(pair.key, _key_pem(key), 0o600)
        _write(pair.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        return pair


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
