"""compose/docker-compose.yml: validated by the Compose specification's own JSON schema, then
started as local processes, and a job acquires and yields through what it started.

Validation: ``check-jsonschema --builtin-schema vendor.compose-spec`` (PyPI
``check-jsonschema``, which ships the compose-spec project's ``compose-spec.json``, Apache-2.0,
and validates with the ``jsonschema`` library). A file with a misspelt key fails the same
check, so the check is known to be strict.

Start: no container engine runs here (README, "What the deployment tests exercise"). Each
service's command and environment, with Compose's interpolation (``${TIMESLICE_BACKEND:-sim}``
with nothing set) and its YAML anchors, runs as a pod of tests.deploy.pods: its volumes at
their container paths, the service names on loopback. The certificates are made by the
commands docs/deployment.md gives for Compose. Order follows ``depends_on``: etcd (healthy over
mutual TLS as ``etcd``), ``etcd-auth`` (must complete successfully), the three orchestrators,
the two agents, then the ``demo`` profile (``docker compose --profile demo up``): the two
workers services register with their agents, and ``demo-job`` takes turns on ``demo-pool`` as
two jobs until it has seen ``DEMO_SWITCHES`` switches (set through Compose's interpolation, as
``DEMO_SWITCHES=3 docker compose ...`` would). jaeger, prometheus and grafana are third-party
images and are not started (the services' OTLP exporter then finds no receiver at
``jaeger:4317``, which they survive); ``agent-gpu`` is in the ``gpu`` profile, not started.
The ``pid: service:agent-N`` of the demo workers is not emulated (every pod here shares this
machine's pid namespace); the test checks that each names the agent whose socket it uses.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.compose import (
    depends_on,
    load,
    service_argv,
    service_env,
    service_mounts,
)
from tests.deploy.pods import (
    ROOT,
    Mount,
    Pod,
    PodSet,
    bind_own_address,
    doc_block,
    dockerfile_entrypoint,
    http_ok,
    https_get,
    image_env,
    loopback_block,
    run_doc_block,
)
from timeslice_orchestrator.visibility import OTHER_JOB

COMPOSE = ROOT / "compose" / "docker-compose.yml"
DOCS = ROOT / "docs" / "deployment.md"
CHECK_JSONSCHEMA = Path(sys.executable).parent / "check-jsonschema"
IMAGES: dict[str, tuple[list[str], list[str]]] = {
    "timeslice:dev": (dockerfile_entrypoint(ROOT / "Dockerfile"), []),
    "quay.io/coreos/etcd:v3.5.17": ([], ["/usr/local/bin/etcd"]),
}
NOT_STARTED = {
    "jaeger": "third-party image (Jaeger v2)",
    "prometheus": "third-party image",
    "grafana": "third-party image",
}
GROUP = "compose-pool"
JOBS = ("job-a", "job-b")
PROFILES = {"demo"}
DEMO_SWITCHES = 3


def _check(path: Path) -> subprocess.CompletedProcess[str]:
    if not CHECK_JSONSCHEMA.exists():
        pytest.skip("check-jsonschema (the dev extra) is not installed")
    return subprocess.run(
        [str(CHECK_JSONSCHEMA), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_compose_file_is_valid_by_the_compose_spec_schema(tmp_path: Path) -> None:
    result = _check(COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr
    # The same check refuses a misspelt key: it really validates against the spec.
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(
        COMPOSE.read_text().replace("    depends_on: [etcd]\n", "    depends_onn: [etcd]\n", 1)
    )
    assert broken.read_text() != COMPOSE.read_text()
    refused = _check(broken)
    assert refused.returncode != 0 and "depends_onn" in refused.stdout, refused.stdout


def make_certs(tmp: Path) -> Path:
    """compose/certs, made with the commands docs/deployment.md gives (docker stubbed)."""
    (tmp / "compose").mkdir()
    prelude = 'docker() { echo "(not run here: docker $*)" >&2; }'
    run_doc_block(doc_block(DOCS, "## Compose (`compose/`)"), tmp, prelude)
    return tmp / "compose" / "certs"


def etcd_healthy(pod: Pod, certs: Path) -> bool:
    status, body = https_get(
        pod.ip,
        2379,
        "/health",
        server_name=pod.name,
        ca=certs / "etcd-ca.crt",
        cert=certs / "etcd-root.crt",
        key=certs / "etcd-root.key",
    )
    return status == 200 and json.loads(body).get("health") == "true"


def http_port(argv: list[str]) -> str:
    """The HOST:PORT after ``--http`` in a service's command."""
    for flag, value in itertools.pairwise(argv):
        if flag == "--http":
            return value
        if flag.startswith("--http="):
            return flag.split("=", 1)[1]
    raise AssertionError(f"no --http in {argv}")


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0, reason="pods need mount namespaces (run as root)")
def test_compose_services_start_and_serve_a_switch(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    compose = load(COMPOSE, env={"DEMO_SWITCHES": str(DEMO_SWITCHES), "DEMO_HOLD": "1"})
    services: dict[str, dict[str, Any]] = compose["services"]
    started = [
        n
        for n, s in services.items()
        if n not in NOT_STARTED and (not s.get("profiles") or PROFILES & set(s["profiles"]))
    ]
    assert set(started) == {
        "etcd",
        "etcd-auth",
        "orchestrator-0",
        "orchestrator-1",
        "orchestrator-2",
        "agent-0",
        "agent-1",
        "demo-workers-0",
        "demo-workers-1",
        "demo-job",
    }, started
    assert services["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")
    address = loopback_block(64)
    pods = PodSet(tmp_path)
    ips = {name: address(i + 1) for i, name in enumerate(services)}
    project = compose.get("name", "compose")
    for name, ip in ips.items():
        # Compose's DNS: the service name and the container name.
        pods.add_name(name, ip)
        pods.add_name(f"{project}-{name}-1", ip)
    named = tmp_path / "volumes"
    planned: dict[str, Pod] = {}
    for name in started:
        service = services[name]
        assert service["image"] in IMAGES, f"{name}: unknown image {service['image']}"
        entrypoint, cmd = IMAGES[service["image"]]
        argv = [bind_own_address(a, ips[name]) for a in service_argv(service, entrypoint, cmd)]
        env = {**image_env(), **service_env(service)}
        mounts = service_mounts(service, COMPOSE.parent, {"./certs": certs}, named)
        planned[name] = Pod(name=name, ip=ips[name], argv=argv, env=env, mounts=mounts)

    def dependencies_met(name: str) -> None:
        for dep, condition in depends_on(services[name]).items():
            pod = planned[dep]
            if condition == "service_completed_successfully":
                assert pod.proc is not None and pod.proc.returncode == 0, dep
            else:
                assert pod.proc is not None, f"{name} before {dep}"

    with pods.running():
        etcd = pods.start(planned["etcd"])
        pods.wait_for(
            "etcd healthy (https://etcd:2379/health)",
            functools.partial(etcd_healthy, etcd, certs),
            [etcd],
        )
        dependencies_met("etcd-auth")
        code = pods.run_to_completion(planned["etcd-auth"], timeout=60)
        assert code == 0, pods.fail(f"etcd-auth exited {code}", planned["etcd-auth"], etcd)
        orchestrators = [planned[f"orchestrator-{i}"] for i in range(3)]
        for pod in orchestrators:
            dependencies_met(pod.name)
            pods.start(pod)
        for pod in orchestrators:
            url = f"http://{http_port(pod.argv)}/readyz"
            pods.wait_for(f"{pod.name} ready ({url})", functools.partial(http_ok, url), [pod, etcd])
        agents = [planned["agent-0"], planned["agent-1"]]
        for pod in agents:
            dependencies_met(pod.name)
            assert "--backend" in pod.argv and pod.argv[pod.argv.index("--backend") + 1] == "sim"
            pods.start(pod)
        for pod in agents:
            url = f"http://{http_port(pod.argv)}/readyz"
            pods.wait_for(
                f"{pod.name} ready ({url})",
                functools.partial(http_ok, url),
                [pod, *orchestrators],
            )

        # A job on this machine's two "nodes": the agents' sockets in the agent-run volume.
        run_volume = next(m.source for m in agents[0].mounts if m.path == "/run/timeslice")
        sockets = []
        for pod in agents:
            socket = pod.argv[pod.argv.index("--worker-socket") + 1]
            sockets.append(socket)
        out = tmp_path / "job-out"
        out.mkdir()
        # The operator's certificate, as the documented exports use: it may act as any job.
        env = {
            **image_env(),
            "TIMESLICE_TARGET": ",".join(f"{p.name}:50051" for p in orchestrators),
            "TIMESLICE_TLS_CA": "/certs/ca.crt",
            "JOB_IDS": ",".join(JOBS),
            "GROUP": GROUP,
            "AGENT_SOCKETS": ",".join(sockets),
            "RESULT": "/out/result.json",
        }
        for i in range(len(JOBS)):
            env[f"JOB_{i}_TLS_CERT"] = "/certs/operator.crt"
            env[f"JOB_{i}_TLS_KEY"] = "/certs/operator.key"
        job = Pod(
            name="job",
            ip=address(200),
            argv=["python", str(Path(__file__).with_name("job_pod.py"))],
            env=env,
            mounts=[
                Mount("/run/timeslice", run_volume),
                Mount("/certs", certs, read_only=True),
                Mount("/out", out),
            ],
        )
        code = pods.run_to_completion(job, timeout=120)
        assert code == 0, pods.fail(f"the job pod exited {code}", job, *agents, *orchestrators)
        result = json.loads((out / "result.json").read_text())
        first, second = result["steps"]
        nodes = ("node-0", "node-1")
        assert first["resident"] == dict.fromkeys(nodes, JOBS[0]), result
        assert second["resident"] == dict.fromkeys(nodes, JOBS[1]), result

        # The demo profile: its workers on each agent's socket, then its jobs switching.
        demo_workers = [planned["demo-workers-0"], planned["demo-workers-1"]]
        for agent, pod in zip(agents, demo_workers, strict=True):
            # Registration needs the agent's pid namespace: the one whose socket it dials.
            assert services[pod.name]["pid"] == f"service:{agent.name}", pod.name
            socket = pod.argv[pod.argv.index("--socket") + 1]
            assert socket == agent.argv[agent.argv.index("--worker-socket") + 1], pod.argv
            dependencies_met(pod.name)
            pods.start(pod)
        for pod in demo_workers:
            pods.wait_for(
                f"{pod.name} registered both jobs",
                functools.partial(lambda p: p.tail().count(" registered ") == 2, pod),
                [pod, *agents],
            )
        demo = planned["demo-job"]
        dependencies_met(demo.name)
        code = pods.run_to_completion(demo, timeout=120)
        assert code == 0, pods.fail(f"demo-job exited {code}", demo, *demo_workers, *agents)
        log = demo.tail(200)
        # The demo's jobs have certificates of their own: each reads the other as another
        # tenant (docs/security.md, Reads), never by name.
        switched = [line for line in log.splitlines() if f"switched from {OTHER_JOB}" in line]
        assert len(switched) >= DEMO_SWITCHES, pods.fail("too few switches", demo)
        assert f"done: {len(switched)} switches" in log, log
        down = [p for p in (*orchestrators, *agents, *demo_workers, etcd) if not p.running()]
        assert not down, pods.fail("pods exited", *down)
