"""A throw-away certificate authority and the certificates of a timeslice deployment.

``timeslice dev cluster --tls``, the demo, the tests and ``timeslice dev certs --out DIR``
(the documented way to make the Secrets of the Compose and Kubernetes deployments) all use
this one module, so every component's certificate carries what the others check:

==========================  ==============================================================
file                        what it is
==========================  ==============================================================
``ca.crt`` / ``ca.key``     the CA every side trusts (keep ``ca.key`` away from services)
``orchestrator.*``          replicas' server certificate (DNS ``localhost`` and the names
                            given, IP 127.0.0.1 and ::1)
``etcd-server.*``           etcd's server certificate
``etcd-client.*``           the replicas' certificate towards etcd: its CN is the etcd user
                            (``timeslice``) whose role reaches only the key prefix
``etcd-root.*``             etcd's ``root`` (sets up auth; tests that compact)
``operator.*``              an operator: SAN URI ``timeslice://operator``; may act as any job
``node-<name>.*``           an agent: SAN URI ``timeslice://node/<name>``, CN ``<name>``
``job-<id>.*``              a job: SAN URI ``timeslice://job/<id>``, CN ``<id>``
==========================  ==============================================================

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
    "ETCD_USER",
    "OPERATOR_URI",
    "CertPair",
    "Pki",
    "job_uri",
    "node_uri",
]

OPERATOR_URI = "timeslice://operator"
ETCD_USER = "timeslice"
DEFAULT_DAYS = 365


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

    :meth:`create` makes the CA and the service certificates; :meth:`node`, :meth:`job` and
    :meth:`issue` add more, signed by the same CA, at any time.
    """

    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

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
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "timeslice dev CA")])
        start = _now() - datetime.timedelta(minutes=5)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
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
        _write(pki.directory / "ca.key", _key_pem(key), 0o600)
        _write(pki.ca, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        names = ["localhost", "127.0.0.1", "::1", *hosts]
        pki.issue("orchestrator", common_name="timeslice-orchestrator", hosts=names, days=days)
        pki.issue("etcd-server", common_name="etcd", hosts=names, days=days)
        pki.issue("etcd-client", common_name=ETCD_USER, client=True, days=days)
        pki.issue("etcd-root", common_name="root", client=True, days=days)
        pki.issue("operator", common_name="operator", uris=[OPERATOR_URI], client=True, days=days)
        for node in nodes:
            pki.node(node, days=days)
        for job in jobs:
            pki.job(job, days=days)
        return pki

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
        """
        ca_key = serialization.load_pem_private_key(
            (self.directory / "ca.key").read_bytes(), password=None
        )
        assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
        ca_cert = x509.load_pem_x509_certificate(self.ca.read_bytes())
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
