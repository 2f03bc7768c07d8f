"""What the kubelet would make of a rendered container: its command line, its environment
and its volumes, resolved the way Kubernetes resolves them.

- ``argv``: ``command`` (else the image's ENTRYPOINT) then ``args`` (else the image's CMD,
  only when ``command`` is not set either), each with ``$(VAR)`` expanded from the container's
  environment (``$$`` is a literal ``$``; an undefined ``$(VAR)`` stays as written).
- ``env``: the service links of the namespace's Services (``enableServiceLinks`` defaults to
  true), ``envFrom``, then ``env`` in order; a ``value`` may refer to variables defined
  before it; ``valueFrom`` reads the downward API (``fieldRef``), a Secret (``secretKeyRef``)
  or a ConfigMap (``configMapKeyRef``). ``HOSTNAME`` is the pod's name.
- volumes: a Secret or ConfigMap becomes a directory of its keys (``items`` and
  ``defaultMode`` honoured), a ``hostPath`` a directory of the emulated node, a claim of a
  ``volumeClaimTemplate`` or an ``emptyDir`` a directory of the pod.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.deploy.pods import Mount

Obj = dict[str, Any]

_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (k8s.io/kubernetes third_party/forked/golang/expansion)."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env.get(name, match.group(0))

    return _REF.sub(one, text)


def render(kubectl: Path, kustomization: Path) -> list[Obj]:
    import yaml

    proc = subprocess.run(
        [str(kubectl), "kustomize", str(kustomization)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"kubectl kustomize {kustomization} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def one(docs: list[Obj], kind: str, name: str) -> Obj:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def objects_from_json_stream(text: str) -> list[Obj]:
    """``kubectl ... -o json`` output of several commands, one object after another."""
    decoder = json.JSONDecoder()
    objects: list[Obj] = []
    index = 0
    while True:
        while index < len(text) and text[index].isspace():
            index += 1
        if index >= len(text):
            return objects
        obj, index = decoder.raw_decode(text, index)
        objects.append(obj)


@dataclass(slots=True)
class PodIdentity:
    """What the API server and the scheduler give a pod, as the downward API shows it."""

    name: str
    namespace: str
    node: str
    ip: str
    host_ip: str
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    service_account: str = "default"
    uid: str = "00000000-0000-0000-0000-000000000000"


def field_value(path: str, pod: PodIdentity) -> str:
    simple = {
        "metadata.name": pod.name,
        "metadata.namespace": pod.namespace,
        "metadata.uid": pod.uid,
        "spec.nodeName": pod.node,
        "spec.serviceAccountName": pod.service_account,
        "status.hostIP": pod.host_ip,
        "status.hostIPs": pod.host_ip,
        "status.podIP": pod.ip,
        "status.podIPs": pod.ip,
    }
    if path in simple:
        return simple[path]
    keyed = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if keyed:
        source = pod.labels if keyed.group(1) == "labels" else pod.annotations
        assert keyed.group(2) in source, f"fieldRef {path}: the pod has no such key"
        return source[keyed.group(2)]
    raise AssertionError(f"fieldRef {path} is not a field the downward API gives")


@dataclass(slots=True)
class Cluster:
    """The API objects pods read from: Secrets, ConfigMaps, Services."""

    namespace: str
    secrets: dict[str, dict[str, bytes]] = field(default_factory=dict)
    config_maps: dict[str, dict[str, str]] = field(default_factory=dict)
    services: list[Obj] = field(default_factory=list)
    service_ips: dict[str, str] = field(default_factory=dict)

    def add_secret(self, obj: Obj) -> None:
        assert obj["kind"] == "Secret", obj["kind"]
        data = {k: base64.b64decode(v) for k, v in obj.get("data", {}).items()}
        data.update({k: v.encode() for k, v in obj.get("stringData", {}).items()})
        self.secrets[obj["metadata"]["name"]] = data

    def _key(self, kind: str, ref: Obj) -> str | None:
        store: dict[str, Any] = self.secrets if kind == "Secret" else self.config_maps
        name, key = ref["name"], ref["key"]
        if name not in store or key not in store[name]:
            assert ref.get("optional"), f"{kind} {name} has no key {key} (and it is not optional)"
            return None
        value = store[name][key]
        return value.decode() if isinstance(value, bytes) else str(value)

    def service_links(self) -> dict[str, str]:
        """The ``<SVC>_SERVICE_HOST`` / ``<SVC>_PORT...`` variables of every Service with a
        cluster IP (headless ones get none), as the kubelet sets them."""
        env: dict[str, str] = {}
        for svc in self.services:
            spec = svc["spec"]
            if spec.get("clusterIP") == "None":
                continue
            name = svc["metadata"]["name"]
            prefix = name.upper().replace("-", "_")
            ip = self.service_ips[name]
            ports = spec.get("ports", [])
            if not ports:
                continue
            env[f"{prefix}_SERVICE_HOST"] = ip
            env[f"{prefix}_SERVICE_PORT"] = str(ports[0]["port"])
            for port in ports:
                if port.get("name"):
                    port_name = port["name"].upper().replace("-", "_")
                    env[f"{prefix}_SERVICE_PORT_{port_name}"] = str(port["port"])
            first = ports[0]
            env[f"{prefix}_PORT"] = f"{first.get('protocol', 'TCP').lower()}://{ip}:{first['port']}"
            for port in ports:
                proto = port.get("protocol", "TCP")
                base = f"{prefix}_PORT_{port['port']}_{proto}"
                env[base] = f"{proto.lower()}://{ip}:{port['port']}"
                env[f"{base}_PROTO"] = proto.lower()
                env[f"{base}_PORT"] = str(port["port"])
                env[f"{base}_ADDR"] = ip
        return env

    def container_env(
        self, pod_spec: Obj, container: Obj, pod: PodIdentity, image_env: dict[str, str]
    ) -> dict[str, str]:
        env = dict(image_env)
        env["HOSTNAME"] = pod.name
        if pod_spec.get("enableServiceLinks", True):
            env.update(self.service_links())
        # The kubelet adds the API server's own Service everywhere; no API server runs here.
        env.update(
            {
                "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": "443",
                "KUBERNETES_SERVICE_PORT_HTTPS": "443",
                "KUBERNETES_PORT": "tcp://127.0.0.1:443",
            }
        )
        declared: dict[str, str] = {}
        for source in container.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "secretRef" in source:
                items = {
                    k: v.decode() for k, v in self.secrets[source["secretRef"]["name"]].items()
                }
            else:
                items = dict(self.config_maps[source["configMapRef"]["name"]])
            declared.update({prefix + k: v for k, v in items.items()})
        for entry in container.get("env", []):
            name = entry["name"]
            if "valueFrom" not in entry:
                # A value refers to what is defined before it (service links included).
                declared[name] = expand(str(entry.get("value", "")), {**env, **declared})
                continue
            source = entry["valueFrom"]
            value: str | None
            if "fieldRef" in source:
                value = field_value(source["fieldRef"]["fieldPath"], pod)
            elif "secretKeyRef" in source:
                value = self._key("Secret", source["secretKeyRef"])
            elif "configMapKeyRef" in source:
                value = self._key("ConfigMap", source["configMapKeyRef"])
            else:
                raise AssertionError(f"env {name}: valueFrom {sorted(source)} is not emulated")
            if value is not None:
                declared[name] = value
        env.update(declared)
        return env

    def volume_dir(self, volume: Obj, mount: Obj, pod_dir: Path, node_dir: Path) -> Path:
        name = str(volume["name"])
        if "secret" in volume or "configMap" in volume:
            kind = "secret" if "secret" in volume else "configMap"
            spec = volume[kind]
            store_name = spec["secretName"] if kind == "secret" else spec["name"]
            store = self.secrets if kind == "secret" else self.config_maps
            assert store_name in store, f"volume {name}: no {kind} {store_name} in the namespace"
            raw = store[store_name]
            mode = int(spec.get("defaultMode", 0o644))
            directory = pod_dir / "volumes" / name
            directory.mkdir(parents=True, exist_ok=True)
            items = spec.get("items") or [{"key": k, "path": k} for k in raw]
            for item in items:
                assert item["key"] in raw, (
                    f"volume {name}: {kind} {store_name} has no {item['key']}"
                )
                data = raw[item["key"]]
                path = directory / item["path"]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data if isinstance(data, bytes) else str(data).encode())
                path.chmod(int(item.get("mode", mode)))
            return directory
        if "hostPath" in volume:
            directory = node_dir / str(volume["hostPath"]["path"]).lstrip("/")
            directory.mkdir(parents=True, exist_ok=True)
            return directory
        if "emptyDir" in volume or "persistentVolumeClaim" in volume or volume.get("claim"):
            directory = pod_dir / "volumes" / name
            directory.mkdir(parents=True, exist_ok=True)
            return directory
        raise AssertionError(f"volume {name}: kind {sorted(volume)} is not emulated")

    def mounts(self, pod_spec: Obj, container: Obj, pod_dir: Path, node_dir: Path) -> list[Mount]:
        volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
        mounts: list[Mount] = []
        for mount in container.get("volumeMounts", []):
            assert "subPath" not in mount, "subPath mounts are not emulated"
            # A volumeClaimTemplate's claim is a volume of every pod of the StatefulSet.
            volume = volumes.get(mount["name"], {"name": mount["name"], "claim": True})
            source = self.volume_dir(volume, mount, pod_dir, node_dir)
            mounts.append(Mount(mount["mountPath"], source, bool(mount.get("readOnly"))))
        return mounts


def container_argv(
    container: Obj, env: dict[str, str], entrypoint: list[str], cmd: list[str]
) -> list[str]:
    """The process a container runs: Kubernetes' rules for command/args over the image's."""
    if "command" in container:
        argv = list(container["command"]) + list(container.get("args", []))
    elif "args" in container:
        argv = entrypoint + list(container["args"])
    else:
        argv = entrypoint + cmd
    return [expand(str(a), env) for a in argv]


def dns_names(service: str, namespace: str) -> list[str]:
    """The names a pod of ``namespace`` may use for ``service`` (cluster DNS and its search
    path ``<namespace>.svc.cluster.local svc.cluster.local cluster.local``)."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]
