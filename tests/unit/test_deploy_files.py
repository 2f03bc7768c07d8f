"""The compose file and Kubernetes manifests start our services with arguments they accept.

No container runtime here, so these checks read the files: every service command goes
through the real argument parsers, every agent points at orchestrators that exist, every
kustomization names files that exist, and every patch path exists in what it patches.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from timeslice_agent.config import parse_config
from timeslice_orchestrator.config import parse_args

ROOT = Path(__file__).resolve().parents[2]


_COMPOSE_VAR = re.compile(r"\$\$|\$\{[A-Za-z_][A-Za-z0-9_]*(?::?-([^}]*))?\}")


def _interpolate(text: str) -> str:
    """Expand ``${VAR:-default}``, ``${VAR-default}``, ``${VAR}`` and ``$$`` as compose does
    with every variable unset: the command a plain ``docker compose up`` runs."""
    return _COMPOSE_VAR.sub(lambda m: "$" if m.group(0) == "$$" else m.group(1) or "", text)


def _env(container: dict[str, Any]) -> dict[str, str]:
    env = container.get("environment") or container.get("env") or {}  # compose, Kubernetes
    if isinstance(env, dict):
        return {k: str(v) for k, v in env.items()}
    return {e["name"]: str(e.get("value", "from-field")) for e in env}


def _check_command(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> str:
    service, args = argv[0], argv[1:]
    if service == "orchestrator":
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        parse_args(args)
    else:
        assert service == "agent", argv
        parse_config(args, env)
    return service


def test_compose_services_start_with_valid_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    kinds = {
        name: _check_command([_interpolate(str(a)) for a in svc["command"]], _env(svc), monkeypatch)
        for name, svc in services.items()
        if name.startswith(("orchestrator", "agent"))
    }
    assert sorted(kinds.values()).count("orchestrator") == 3
    for name, svc in services.items():
        if kinds.get(name) == "agent":
            targets = svc["command"][svc["command"].index("--orchestrator") + 1].split(",")
            assert {t.split(":")[0] for t in targets} <= set(services)
    assert {"etcd", "jaeger"} <= set(services)


def _documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _pointer(doc: Any, path: str) -> Any:
    for part in path.strip("/").split("/"):
        doc = doc[int(part)] if isinstance(doc, list) else doc[part]
    return doc


@pytest.mark.parametrize("overlay", ["base", "overlays/dev", "overlays/gpu"])
def test_kustomizations_resolve(overlay: str, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = ROOT / "k8s" / overlay
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    docs: list[dict[str, Any]] = []
    for resource in kustomization["resources"]:
        target = (folder / resource).resolve()
        if target.is_dir():
            base = yaml.safe_load((target / "kustomization.yaml").read_text())
            for r in base["resources"]:
                docs += _documents(target / r)
        else:
            docs += _documents(target)
    by_kind = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for patch in kustomization.get("patches", []):
        doc = by_kind[(patch["target"]["kind"], patch["target"]["name"])]
        for op in yaml.safe_load(patch["patch"]):
            parent, _, last = op["path"].rpartition("/")
            if op["op"] in ("replace", "remove"):
                _pointer(doc, op["path"])
            elif last != "-":
                _pointer(doc, parent)
    for kind in ("Deployment", "DaemonSet"):
        for (k, _), doc in by_kind.items():
            if k != kind:
                continue
            container = doc["spec"]["template"]["spec"]["containers"][0]
            _check_command(container["args"], _env(container), monkeypatch)


def test_compose_runs_every_hop_on_tls_from_the_certs_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    monkeypatch.delenv("TIMESLICE_ORCHESTRATOR_INSECURE", raising=False)
    seen = 0
    for name, svc in services.items():
        argv = [_interpolate(str(a)) for a in svc.get("command", [])]
        assert "--insecure" not in argv, name
        if not name.startswith(("orchestrator", "agent")):
            continue
        mounts = [str(v) for v in svc.get("volumes", [])]
        assert "./certs:/certs:ro" in mounts, name
        env = _env(svc)
        if argv[0] == "orchestrator":
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            config = parse_args(argv[1:])
            files = [config.tls, config.etcd_tls]
        else:
            files = [parse_config(argv[1:], env).tls]
        for tls in files:
            assert tls is not None, name
            assert all(p.startswith("/certs/") for p in tls.paths()), (name, tls)
        seen += 1
    assert seen == 6  # 3 replicas, agent-0, agent-1, agent-gpu
    etcd = " ".join(services["etcd"]["command"])
    assert "http://" not in etcd and "--client-cert-auth" in etcd
    assert "auth enable" in services["etcd-auth"]["command"][0]
    depends = services["orchestrator-0"]["depends_on"]
    assert depends["etcd-auth"]["condition"] == "service_completed_successfully"
