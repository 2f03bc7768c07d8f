"""``timeslice dev certs`` (timeslice_tools.dev.certs): a deployment's PKI written to a folder,
with the names each certificate must carry, private keys readable by their owner alone, and an
existing CA kept unless forced. The session's PKI of every TLS test is made the same way."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
from pathlib import Path

from cryptography import x509

TIMESLICE = [sys.executable, "-m", "timeslice_tools.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TIMESLICE, *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_dev_certs_writes_a_deployment_and_keeps_an_existing_ca(tmp_path: Path) -> None:
    out_dir = tmp_path / "certs"
    made = run("dev", "certs", "--out", str(out_dir), "--nodes", "gpu-1", "--jobs", "rl-a",
               "--hosts", "timeslice-orchestrator", "10.0.0.7")  # fmt: skip
    assert made.returncode == 0, made.stderr
    names = {Path(line).name for line in made.stdout.split()}
    for stem in ("ca", "orchestrator", "etcd-server", "etcd-client", "etcd-root", "operator",
                 "node-gpu-1", "job-rl-a"):  # fmt: skip
        assert {f"{stem}.crt", f"{stem}.key"} <= names, (stem, names)
        assert (out_dir / f"{stem}.key").stat().st_mode & 0o777 == 0o600
    server = x509.load_pem_x509_certificate((out_dir / "orchestrator.crt").read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "timeslice-orchestrator" in sans.get_values_for_type(x509.DNSName)
    assert ipaddress.ip_address("10.0.0.7") in sans.get_values_for_type(x509.IPAddress)
    node = x509.load_pem_x509_certificate((out_dir / "node-gpu-1.crt").read_bytes())
    uris = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert uris.get_values_for_type(x509.UniformResourceIdentifier) == ["timeslice://node/gpu-1"]
    # A second run would replace the CA that everything trusts: only with --force.
    ca = (out_dir / "ca.crt").read_bytes()
    again = run("dev", "certs", "--out", str(out_dir))
    assert again.returncode == 2 and "already holds a CA" in again.stderr
    assert (out_dir / "ca.crt").read_bytes() == ca
    forced = run("dev", "certs", "--out", str(out_dir), "--force")
    assert forced.returncode == 0 and (out_dir / "ca.crt").read_bytes() != ca
    bad = run("dev", "certs", "--out", str(tmp_path / "x"), "--nodes", "../escape")
    assert bad.returncode == 2 and "file name" in bad.stderr
