"""Two RL jobs on the same GPUs on Kubernetes (k8s/examples/shared-gpus), checked and started.

- The example renders with ``kubectl kustomize`` and every object (the ``resource.k8s.io/v1``
  ResourceClaims included) validates strictly at Kubernetes 1.34 and at the newest version
  ``kubernetes-validate`` knows.
- Its shape: one ResourceClaim per timeslice group, named (not templated) by every pod of the
  group in both jobs; pods only on the agent's nodes, tolerating the taint the agent tolerates;
  job and group from the pods' labels; the jobs' Secrets are the ones docs/deployment.md makes.
- The monitoring component's PodMonitors select the orchestrator's and the agents' pods and a
  port they have; the scrape annotations name the same port.
- The image the manifests run is the one ``make image`` builds, from files that exist.
- Placed: the pool docs/deployment.md creates for a launcher has the example's claims, one
  per group, and Place answers each role a group of it with the claim that group's pods name.
- Started: the base deployment as local processes (tests.deploy.test_k8s_start), then the
  example's pods, each with its container's rendered environment (downward API from its labels,
  its job's Secret mounted) and tests/deploy/shared_job_pod.py as its command. Job A's trainer
  and sampler acquire their groups, then job B's: the agent switches both groups from A to B
  and A's workers are stopped (freeze backend).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.kube import Cluster, Obj, PodIdentity, one, render
from tests.deploy.pods import ROOT, Pod, PodSet, http_ok, image_env
from tests.deploy.test_k8s_start import (
    DOCS,
    K8S,
    NODE,
    deployment,
    kubectl,
    plan,
    probe_url,
    provision_node,
    start,
)
from timeslice.cli.place import parse_claims
from timeslice_orchestrator.pool_plans import claims_of, plan_place
from timeslice_orchestrator.store.pools import PoolState
from timeslice_orchestrator.store.records import PoolAssignmentsRecord, PoolAuditRecord, PoolRecord

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate (the dev extra) is not installed"
)

EXAMPLE = K8S / "examples" / "shared-gpus"
JOBS_NAMESPACE = "rl-jobs"
GROUPS = ("trainer-pool", "sampler-pool")
# A job's processes on a node are in one group: each group's claim takes its own node.
NODES = {"trainer-pool": NODE, "sampler-pool": "gpu-2"}  # both have docs/deployment.md's keys
JOB_IDS = ("rl-job-a", "rl-job-b")
VERSIONS = ("1.34.0", kubernetes_validate.latest_version())


@functools.cache
def _example() -> tuple[Obj, ...]:
    return tuple(render(kubectl(), EXAMPLE))


def _pods(docs: tuple[Obj, ...]) -> list[Obj]:
    return [d for d in docs if d["kind"] == "Job"]


def _validate(doc: Obj, version: str) -> None:
    name = f"{doc['kind']}/{doc['metadata']['name']}"
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{name} at {version}: {where}: {exc.message}")


@pytest.mark.parametrize("version", VERSIONS)
def test_example_renders_valid_objects(version: str) -> None:
    docs = _example()
    kinds = sorted({d["kind"] for d in docs})
    assert kinds == ["Job", "Namespace", "ResourceClaim"], kinds
    for doc in docs:
        _validate(doc, version)
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == JOBS_NAMESPACE
    # Strict really is strict: a misspelt claim field fails.
    claim = json.loads(json.dumps(one(list(docs), "ResourceClaim", "trainer-pool")))
    claim["spec"]["devices"]["requests"][0]["exactly"]["count_"] = 4
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(claim, version, strict=True)


def test_one_claim_per_group_named_by_every_pod_of_the_group() -> None:
    docs = _example()
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ResourceClaim"}
    assert sorted(claims) == sorted(GROUPS)
    for claim in claims.values():
        assert claim["apiVersion"] == "resource.k8s.io/v1"
        (request,) = claim["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
        # No sharing strategy: it would need the driver's alpha feature gates.
        assert "config" not in claim["spec"]["devices"]
    agent = one(render(kubectl(), K8S / "overlays" / "gpu"), "DaemonSet", "timeslice-agent")
    agent_spec = agent["spec"]["template"]["spec"]
    seen: dict[str, set[str]] = {g: set() for g in GROUPS}
    for job in _pods(docs):
        template = job["spec"]["template"]
        labels = template["metadata"]["labels"]
        spec = template["spec"]
        group, job_id = labels["timeslice.io/group"], labels["timeslice.io/job"]
        assert labels["timeslice.io/job-id"] == job_id  # the llm-d reference's key too
        (claim_ref,) = spec["resourceClaims"]
        assert claim_ref.get("resourceClaimName") == group, claim_ref  # shared, not a template
        (container,) = spec["containers"]
        assert container["resources"]["claims"] == [{"name": claim_ref["name"]}]
        assert "limits" not in container["resources"]  # no device-plugin GPUs
        seen[group].add(job_id)
        # On the agent's nodes only, tolerating their taint.
        assert spec["nodeSelector"].items() >= agent_spec["nodeSelector"].items()
        shared = [t for t in agent_spec["tolerations"] if t["key"] == "timeslice.io/shared"]
        assert shared and all(t in spec["tolerations"] for t in shared)
        env = Cluster(JOBS_NAMESPACE).container_env(
            spec,
            container,
            PodIdentity("p", JOBS_NAMESPACE, NODE, "127.0.0.1", "127.0.0.1", labels=labels),
            {},
        )
        assert (env["TIMESLICE_JOB_ID"], env["TIMESLICE_GROUP"]) == (job_id, group)
        assert env["TIMESLICE_TARGET"].startswith("timeslice.timeslice.svc:")
        volumes = {v["name"]: v for v in spec["volumes"]}
        secret = next(v["secret"]["secretName"] for v in volumes.values() if "secret" in v)
        assert secret == f"timeslice-job-{job_id}"
    assert seen == {g: set(JOB_IDS) for g in GROUPS}


def test_podmonitors_select_the_pods_and_their_metrics_port(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources: [{os.path.relpath(K8S / 'overlays' / 'gpu', overlay)}]\n"
        f"components: [{os.path.relpath(K8S / 'components' / 'monitoring', overlay)}]\n"
    )
    docs = render(kubectl(), overlay)
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    workloads = {
        "timeslice-orchestrator": one(docs, "Deployment", "timeslice-orchestrator"),
        "timeslice-agent": one(docs, "DaemonSet", "timeslice-agent"),
    }
    assert sorted(monitors) == sorted(workloads)
    for name, workload in workloads.items():
        monitor = monitors[name]
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert monitor["metadata"]["namespace"] == "timeslice"
        template = workload["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["path"] == "/metrics"
        notes = template["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == ports[endpoint["port"]]
        assert notes["prometheus.io/path"] == "/metrics"


def test_manifests_run_the_image_make_image_builds() -> None:
    proc = subprocess.run(
        ["make", "-n", "image"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    (command,) = [line for line in proc.stdout.splitlines() if "docker build" in line]
    argv = shlex.split(command)
    built = argv[argv.index("-t") + 1]
    assert argv[-1] == "."  # the repository root and its Dockerfile
    images = {
        c["image"]
        for overlay in ("base", "overlays/dev", "overlays/gpu")
        for d in render(kubectl(), K8S / overlay)
        if d["kind"] in ("Deployment", "DaemonSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    }
    assert images == {built}, images
    assert built in DOCS.read_text()
    # Every COPY source of the Dockerfile exists in the build context.
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            sources = line.split()[1:-1]
            missing = [s for s in sources if not s.startswith("--") and not (ROOT / s).exists()]
            assert not missing, line


def _job_pod(template: Obj, name: str, ip: str, cluster: Cluster, work: Path, node: str) -> Pod:
    """The example's pod as the kubelet would make it, with the job program as its command."""
    spec = template["spec"]
    (container,) = spec["containers"]
    labels = dict(template["metadata"]["labels"])
    identity = PodIdentity(name, JOBS_NAMESPACE, node, ip, "127.0.0.1", labels=labels)
    env = cluster.container_env(spec, container, identity, image_env())
    out = work / "job-out"
    env["RESULT"] = str(out / f"{name}.json")
    env["DONE"] = str(out / "done")
    mounts = cluster.mounts(spec, container, work / "pods" / name, work / "nodes" / node)
    argv = ["python", str(Path(__file__).with_name("shared_job_pod.py"))]
    return Pod(name=name, ip=ip, argv=argv, env=env, mounts=mounts)


def _result(path: Path) -> dict[str, Any] | None:
    return dict(json.loads(path.read_text())) if path.exists() else None


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0, reason="pods need mount namespaces (run as root)")
def test_two_jobs_switch_on_the_shared_claims(tmp_path: Path) -> None:
    dep = deployment("base", tmp_path)
    jobs_cluster = dep.others[JOBS_NAMESPACE]
    pods = PodSet(tmp_path)
    plan_ = plan(dep, pods, 64)
    (tmp_path / "job-out").mkdir()
    templates = {
        (
            j["spec"]["template"]["metadata"]["labels"]["timeslice.io/job"],
            re.sub(r".*-", "", j["metadata"]["name"]),
        ): j["spec"]["template"]
        for j in _pods(_example())
    }
    # The DaemonSet's second pod, on the sampler pool's node, with that node's key only.
    provision_node(tmp_path, NODES["sampler-pool"])
    daemonset = one(dep.docs, "DaemonSet", "timeslice-agent")
    agent2 = plan_.planner.pod(daemonset, "timeslice-agent-k7w3n", node=NODES["sampler-pool"])
    with pods.running():
        start(plan_, pods, dep)
        pods.start(agent2)
        url = probe_url(agent2, daemonset["spec"]["template"]["spec"]["containers"][0])
        pods.wait_for(f"agent {agent2.name} ready", lambda: http_ok(url), [agent2])
        results: dict[str, dict[str, Any]] = {}
        for job_id in JOB_IDS:
            started = []
            for role in ("trainer", "sampler"):
                name = f"{job_id}-{role}-x1"
                template = templates[(job_id, role)]
                node = NODES[template["metadata"]["labels"]["timeslice.io/group"]]
                ip = plan_.planner.ip()
                pod = _job_pod(template, name, ip, jobs_cluster, tmp_path, node)
                started.append(pods.start(pod))
            for pod in started:
                path = Path(pod.env["RESULT"])
                pods.wait_for(
                    f"{pod.name} acquired and yielded",
                    lambda path=path: path.exists(),  # type: ignore[misc]
                    [pod, plan_.agent[0], agent2],
                    timeout=90,
                )
                result = _result(path)
                assert result is not None
                results[pod.name] = result
        for job_id in JOB_IDS:
            for group, role in zip(GROUPS, ("trainer", "sampler"), strict=True):
                result = results[f"{job_id}-{role}-x1"]
                assert result["group"] == group and result["granted"] == job_id, result
                # Granted with its own state on the node: job B's acquire moved the node.
                assert result["resident"] == {NODES[group]: job_id}, result
        # Job A's workers were stopped by the switch (freeze backend); job B's run.
        for role in ("trainer", "sampler"):
            assert _state(results[f"rl-job-a-{role}-x1"]["worker"]) == "T", results
            assert _state(results[f"rl-job-b-{role}-x1"]["worker"]) != "T", results
        (tmp_path / "job-out" / "done").touch()
        for pod in list(pods.pods.values()):
            if pod.name.startswith("rl-job-"):
                assert pod.proc is not None
                assert pod.proc.wait(timeout=60) == 0, pods.fail(f"{pod.name} failed", pod)


def _documented_pool() -> tuple[str, list[str], list[str]]:
    """The pool, groups and ``--claim`` arguments of docs/deployment.md's ``timeslice pool
    create`` (the one a launcher of this example places with)."""
    (line,) = [
        line for line in DOCS.read_text().splitlines() if line.startswith("timeslice pool create")
    ]
    argv = shlex.split(line)
    claims = [argv[i + 1] for i, a in enumerate(argv) if a == "--claim"]
    return argv[3], argv[argv.index("--groups") + 1].split(","), claims


def test_a_placed_role_gets_the_claim_the_examples_pods_of_its_group_name() -> None:
    docs = _example()
    # The example's claims by the group they serve (their timeslice.io/group label).
    example = {
        d["metadata"]["labels"]["timeslice.io/group"]: d["metadata"]["name"]
        for d in docs
        if d["kind"] == "ResourceClaim"
    }
    pool, groups, args = _documented_pool()
    assert sorted(groups) == sorted(example), (groups, example)
    # The documented pool, checked as CreatePool checks it, has exactly the example's claims.
    claims = claims_of(groups, parse_claims(args))
    assert claims == example
    for job in _pods(docs):
        template = job["spec"]["template"]
        (ref,) = template["spec"]["resourceClaims"]
        assert (
            ref["resourceClaimName"] == claims[template["metadata"]["labels"]["timeslice.io/group"]]
        )
    # What Place answers a new job's roles: a group of the pool and that group's claim.
    config = PoolRecord(groups=groups, cap=0.9, created_at=0.0, claims=claims)
    state = PoolState(pool, config, PoolAssignmentsRecord(), PoolAuditRecord())
    _, results = plan_place(
        state, "rl-job-c", ["trainer", "sampler"], {}, usage=lambda g, j: None,
        running=False, replica="r0", now=1.0,
    )  # fmt: skip
    assert {r.group for r in results} == set(groups), results
    assert all(r.claim == example[r.group] for r in results), results
