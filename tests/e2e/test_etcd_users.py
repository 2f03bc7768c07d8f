"""No job or node certificate is an etcd user, and an OU is not an operator unless asked.

etcd takes a client certificate's CN for its user: a certificate with CN ``root`` or
``timeslice`` from a CA etcd trusts *is* that user. Real processes throughout: the session's
TLS etcd (client certificates and auth on), ``timeslice dev certs``, and TLS clusters.

The certificates that must be refused are minted here with the gRPC hops' CA key directly,
as a misconfigured PKI (or one that predates the reserved names) would issue them:
``Pki.issue`` itself refuses them.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest
from aetcd.rpc import rpc_pb2 as pb
from aetcd.rpc import rpc_pb2_grpc as pb_grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.conftest import ClusterFactory
from timeslice.aio import AsyncTimeSliceClient
from timeslice.errors import PermissionDenied
from timeslice_tools.dev.certs import CertPair, Pki, ReservedName
from timeslice_tools.dev.cluster import LocalCluster
from timeslice_tools.dev.etcd import EtcdServer

pytestmark = pytest.mark.timeout(120)

OPERATOR_OU = "timeslice-operators"


def _mint(
    pki: Pki, name: str, common_name: str, uris: Sequence[str], ou: str | None = None
) -> CertPair:
    """A client certificate signed by ``pki``'s CA (``ca.key``), whatever its names."""
    ca_key = serialization.load_pem_private_key(
        (pki.directory / "ca.key").read_bytes(), password=None
    )
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if ou is not None:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, ou))
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name(attrs))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(u) for u in uris]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    out = pki.directory / "minted"
    out.mkdir(exist_ok=True)
    pair = CertPair(out / f"{name}.crt", out / f"{name}.key")
    pair.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return pair


def _etcd_range(etcd: EtcdServer, ca: Path, pair: CertPair, prefix: bytes) -> int:
    """Read the keys under ``prefix`` from etcd as the certificate ``pair``: how many."""
    creds = grpc.ssl_channel_credentials(
        ca.read_bytes(), pair.key.read_bytes(), pair.cert.read_bytes()
    )
    with grpc.secure_channel(etcd.endpoint, creds) as channel:
        kv = pb_grpc.KVStub(channel)
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        resp = kv.Range(pb.RangeRequest(key=prefix, range_end=end, count_only=True), timeout=5)
        return int(resp.count)


@pytest.mark.parametrize("user", ["root", "timeslice"])
def test_etcd_refuses_a_job_certificate_named_after_its_user(
    tls_etcd_server: EtcdServer, session_pki: Pki, user: str
) -> None:
    assert session_pki.etcd_ca.exists() and session_pki.etcd_ca != session_pki.ca
    # etcd's own users (etcd CA) read the prefix: the same read as a job is refused below.
    for own in (session_pki.etcd_root, session_pki.etcd_client):
        assert _etcd_range(tls_etcd_server, session_pki.etcd_ca, own, b"/timeslice/") >= 0
    job = _mint(session_pki, f"job-as-{user}", user, [f"timeslice://job/{user}"])
    with pytest.raises(grpc.RpcError) as refused:
        _etcd_range(tls_etcd_server, session_pki.etcd_ca, job, b"/timeslice/")
    # Refused at the handshake (its CA is not etcd's): no user, no read.
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value


def test_etcdctl_refuses_a_node_certificate_named_root(
    tls_etcd_server: EtcdServer, session_pki: Pki
) -> None:
    etcdctl = tls_etcd_server.binary.parent / "etcdctl"
    if not etcdctl.exists():
        pytest.skip(f"no etcdctl beside {tls_etcd_server.binary}")
    node = _mint(session_pki, "node-as-root", "root", ["timeslice://node/root"])

    def get(pair: CertPair) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                str(etcdctl),
                f"--endpoints=https://{tls_etcd_server.endpoint}",
                f"--cacert={session_pki.etcd_ca}",
                f"--cert={pair.cert}",
                f"--key={pair.key}",
                "--command-timeout=3s",
                "--dial-timeout=3s",
                "get",
                "/",
                "--prefix",
                "--keys-only",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )

    assert get(session_pki.etcd_root).returncode == 0
    answer = get(node)
    assert answer.returncode != 0, answer.stdout


def _certs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "timeslice_tools.cli", "dev", "certs", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(("flag", "name"), [("--jobs", "root"), ("--nodes", "timeslice")])
def test_dev_certs_refuses_a_reserved_name(tmp_path: Path, flag: str, name: str) -> None:
    answer = _certs("--out", str(tmp_path / "certs"), flag, "ok", name)
    assert answer.returncode == 2, answer
    assert f"{name!r} is an etcd user" in answer.stderr
    assert not (tmp_path / "certs").exists() or not any((tmp_path / "certs").iterdir())
    pki = Pki.create(tmp_path / "pki")
    with pytest.raises(ReservedName, match="is an etcd user"):
        pki.job("root")
    with pytest.raises(ReservedName, match="is an etcd user"):
        pki.node("timeslice")
    with pytest.raises(ReservedName):
        pki.issue("x", common_name="timeslice", uris=["timeslice://operator"])


def test_dev_certs_makes_a_separate_etcd_ca_and_migrates_a_one_ca_directory(
    tmp_path: Path,
) -> None:
    out = tmp_path / "certs"
    assert _certs("--out", str(out), "--jobs", "a").returncode == 0
    pki = Pki(out)
    etcd_ca = x509.load_pem_x509_certificate(pki.etcd_ca.read_bytes())
    ca = x509.load_pem_x509_certificate(pki.ca.read_bytes())
    assert etcd_ca.subject != ca.subject
    for pair in (pki.etcd_server, pki.etcd_client, pki.etcd_root):
        assert x509.load_pem_x509_certificate(pair.cert.read_bytes()).issuer == etcd_ca.subject
    for pair in (pki.orchestrator, pki.operator, pki.job("a")):
        assert x509.load_pem_x509_certificate(pair.cert.read_bytes()).issuer == ca.subject
    # A directory of the one-CA days: no etcd-ca.crt, etcd certificates from ca.crt.
    pki.etcd_ca.unlink()
    (out / "etcd-ca.key").unlink()
    assert _certs("--out", str(out), "--split-etcd-ca").returncode == 0
    new = x509.load_pem_x509_certificate(pki.etcd_ca.read_bytes())
    assert new.subject == etcd_ca.subject and new != etcd_ca
    server = x509.load_pem_x509_certificate(pki.etcd_server.cert.read_bytes())
    assert server.issuer == new.subject
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    again = _certs("--out", str(out), "--split-etcd-ca")
    assert again.returncode == 2 and "already has its own etcd CA" in again.stderr


def _client(cluster: LocalCluster, job: str, pair: CertPair) -> AsyncTimeSliceClient:
    assert cluster.pki is not None
    return AsyncTimeSliceClient(
        cluster.target,
        job_id=job,
        call_timeout=5,
        tls_ca=str(cluster.pki.ca),
        tls_cert=str(pair.cert),
        tls_key=str(pair.key),
    )


async def test_the_orchestrator_refuses_a_certificate_that_names_an_etcd_user(
    cluster_factory: ClusterFactory, session_pki: Pki
) -> None:
    cluster = cluster_factory(replicas=1, agents=0)
    cases = {
        # A job named after an etcd user (CN and URI), and a CN-only claim.
        "timeslice": _mint(
            session_pki, "job-timeslice", "timeslice", ["timeslice://job/timeslice"]
        ),
        "j-root": _mint(session_pki, "cn-root", "root", ["timeslice://job/j-root"]),
    }
    for job, pair in cases.items():
        client = _client(cluster, job, pair)
        try:
            with pytest.raises(PermissionDenied, match="etcd user"):
                await client.acquire("g-reserved", timeout=5)
            with pytest.raises(PermissionDenied, match="etcd user"):
                await client.status("g-reserved")
        finally:
            await client.close()
    assert "is an etcd user" in cluster.log_tail("r0", 200)


async def test_an_operator_ou_is_no_operator_by_default(
    cluster_factory: ClusterFactory, session_pki: Pki
) -> None:
    cluster = cluster_factory(replicas=1, agents=0)
    # OU timeslice-operators, off by default: the certificate acts as its own job only.
    ou = _mint(session_pki, "ou-job", "ou-job", ["timeslice://job/ou-job"], ou=OPERATOR_OU)
    own = _client(cluster, "ou-job", ou)
    other = _client(cluster, "someone-else", ou)
    try:
        grant = await own.acquire("g-ou", timeout=5)
        await own.yield_("g-ou")
        assert grant.job_id == "ou-job"
        with pytest.raises(PermissionDenied, match="may not act as job 'someone-else'"):
            await other.acquire("g-ou", timeout=5)
    finally:
        await own.close()
        await other.close()


async def test_the_operator_ou_is_an_operator_with_the_flag(
    cluster_factory: ClusterFactory, session_pki: Pki
) -> None:
    cluster = cluster_factory(
        replicas=1, agents=0, orchestrator_args=["--tls-operator-ou", OPERATOR_OU]
    )
    ou = _mint(session_pki, "ou-op", "ou-op", ["timeslice://job/ou-op"], ou=OPERATOR_OU)
    other = _client(cluster, "someone-else", ou)
    try:
        grant = await other.acquire("g-ou-flag", timeout=5)
        assert grant.job_id == "someone-else"
        await other.yield_("g-ou-flag")
    finally:
        await other.close()
