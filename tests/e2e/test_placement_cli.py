"""Placement from the command line, end to end (docs/placement.md): ``timeslice status --pool``
shows each role's group, decision, reason and whether it is provisional, and each group's
expected and measured duty (what ``place --show`` prints: one renderer); ``timeslice acquire
--pool P --role R`` acquires the group the orchestrator placed the role on and says which.
Real processes: the CLI in subprocesses against a replica, etcd and a sim agent, over TLS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tests.conftest import ClusterFactory
from timeslice import register
from timeslice_tools.dev.cluster import LocalCluster

POOL = "cli-pool"
GROUPS = ["pc-1", "pc-2"]
ACQUIRE = ["acquire", "--pool", POOL, "--job", "cli-a"]
SIM = ["--sim-state-gb", "0.25", "--sim-bandwidth-gbps", "5"]


def run_many(
    cluster: LocalCluster, *calls: tuple[dict[str, str], list[str]]
) -> list[subprocess.CompletedProcess[str]]:
    """Each ``(environment, timeslice arguments)`` at once (a Python start costs seconds on a
    loaded machine); every wait has a deadline."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "timeslice.cli", *args, "--target", cluster.target],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        for env, args in calls
    ]
    results = []
    for (_, args), proc in zip(calls, procs, strict=True):
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        results.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return results


def events(result: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in result.stdout.splitlines() if line.strip()]


def test_acquire_resolves_a_role_and_status_shows_the_pools_decisions(
    cluster_factory: ClusterFactory,
) -> None:
    # The job's process of each group on a node of its own (a job is in one group per node).
    cluster = cluster_factory(agents=2, agent_args=SIM)
    sockets = [str(cluster.agent_sockets[node]) for node in ("node-0", "node-1")]
    workers = [register(g, job_id="cli-a", socket=s) for g, s in zip(GROUPS, sockets, strict=True)]
    operator, job = cluster.client_env, cluster.job_env("cli-a")
    try:
        both, created = run_many(
            cluster,
            (job, ["acquire", GROUPS[0], "--pool", POOL, "--role", "sampler", "--job", "cli-a"]),
            (operator, ["pool", "create", POOL, "--groups", ",".join(GROUPS), "--json"]),
        )
        # A GROUP and a pool: a usage error, before anything is asked of the orchestrator.
        assert both.returncode == 2, both
        assert "not both" in both.stderr, both.stderr
        assert created.returncode == 0, created
        nowhere, text, as_json = run_many(
            cluster,
            (operator, ["status", "--pool", "no-such-pool", "--json"]),
            (job, [*ACQUIRE, "--role", "sampler", "--hold", "0"]),
            (job, [*ACQUIRE, "--role", "trainer", "--hold", "0", "--json"]),
        )
        # No such pool: not found, exit 3, as for a group.
        assert nowhere.returncode == 3, nowhere
        assert json.loads(nowhere.stderr)["error"] == "not_found", nowhere.stderr
        # Text: the resolved group on stderr, the grant and the yield on stdout as for a GROUP.
        assert text.returncode == 0, text
        (placed,) = [line for line in text.stderr.splitlines() if line.startswith("placed: ")]
        sampler_group = placed.rsplit(" ", 1)[1]
        assert placed == f"placed: cli-a/sampler in pool {POOL} -> group {sampler_group}"
        assert sampler_group in GROUPS
        assert text.stdout.splitlines()[0].startswith("granted epoch=")
        assert text.stdout.splitlines()[-1] == "yielded"
        # JSON: every event names the group it resolved to, with the pool and the role.
        assert as_json.returncode == 0, as_json
        got = events(as_json)
        assert [e["event"] for e in got] == ["granted", "yielded"], got
        trainer_group = got[0]["group_id"]
        assert trainer_group in GROUPS
        assert all(
            (e["group_id"], e["pool"], e["role"], e["job_id"])
            == (trainer_group, POOL, "trainer", "cli-a")
            for e in got
        ), got
        assert "placed: " not in as_json.stderr  # --json: the events say it

        shown_text, shown_json, place_show = run_many(
            cluster,
            (operator, ["status", "--pool", POOL]),
            (operator, ["status", "--pool", POOL, "--json"]),
            (operator, ["place", POOL, "--show", "--json"]),
        )
        assert shown_text.returncode == shown_json.returncode == place_show.returncode == 0
        pool = json.loads(shown_json.stdout)
        assert pool == json.loads(place_show.stdout)  # one view of a pool, whichever command
        slots = {(a["jobId"], a["role"]): a for a in pool["assignments"]}
        assert slots.keys() == {("cli-a", "sampler"), ("cli-a", "trainer")}, slots
        sampler = slots[("cli-a", "sampler")]
        assert sampler["groupId"] == sampler_group and sampler["decision"] == "placed"
        assert sampler["provisional"] and sampler["source"] == "default", sampler
        assert slots[("cli-a", "trainer")]["groupId"] == trainer_group
        duty = {d["groupId"]: d for d in pool["duty"]}
        assert set(duty) == set(GROUPS)
        assert duty[sampler_group]["expected"] > 0
        assert "cli-a/sampler" in duty[sampler_group]["jobs"]
        # The text: each role's group, decision, provisional or measured and reason; each
        # group's expected and measured duty.
        lines = shown_text.stdout.splitlines()
        row = f"  cli-a/sampler -> {sampler_group} (placed; provisional): {sampler['reason']}"
        assert row in lines, shown_text.stdout
        assert any(
            line.startswith(f"  {sampler_group}: expected duty ") and ", measured " in line
            for line in lines
        ), shown_text.stdout
    finally:
        for w in workers:
            w.close()


def test_place_answers_the_groups_claim_for_a_kubernetes_launcher(
    cluster_factory: ClusterFactory,
) -> None:
    # The pool records each group's ResourceClaim (k8s/examples/shared-gpus: one per group);
    # Place answers it with the group, for the pod spec's resourceClaimName.
    cluster = cluster_factory(agents=0)
    operator, job = cluster.client_env, cluster.job_env("k8s-a")
    pool, groups = "claim-pool", ["kc-1", "kc-2"]
    claims = {"kc-1": "gpus-a", "kc-2": "gpus-b"}
    create = ["pool", "create", pool, "--groups", ",".join(groups)]
    created, bad = run_many(
        cluster,
        (operator, [*create, *(f"--claim={g}={c}" for g, c in claims.items()), "--json"]),
        (
            operator,
            ["pool", "create", "other", "--groups", "kc-1", "--claim", "kc-1=GPUs_A", "--json"],
        ),
    )
    assert created.returncode == 0, created
    assert {(c["groupId"], c["claim"]) for c in json.loads(created.stdout)["claims"]} == set(
        claims.items()
    )
    # Not a Kubernetes name: a typed error naming the field, and no pool.
    assert bad.returncode == 2, bad
    error = json.loads(bad.stderr)
    assert error["error"] == "invalid_argument" and "claims[0].claim" in error["message"], error
    as_json, as_env, nowhere = run_many(
        cluster,
        (job, ["place", pool, "--job", "k8s-a", "--role", "trainer", "--json"]),
        (job, ["place", pool, "--job", "k8s-a", "--role", "sampler", "--env"]),
        (operator, ["pool", "show", "other"]),
    )
    assert nowhere.returncode == 3, nowhere
    assert as_json.returncode == 0, as_json
    (trainer,) = json.loads(as_json.stdout)["roles"]
    assert trainer["groupId"] in groups and trainer["claim"] == claims[trainer["groupId"]]
    assert as_env.returncode == 0, as_env
    env = dict(line.split("=", 1) for line in as_env.stdout.splitlines())
    assert env.keys() == {"TIMESLICE_GROUP", "TIMESLICE_CLAIM"}, as_env.stdout
    assert env["TIMESLICE_CLAIM"] == claims[env["TIMESLICE_GROUP"]]
    # Operators change a group's claim; the next Place answers the new one, status shows it.
    other = next(g for g in groups if g != trainer["groupId"])
    changed, refused, again = run_many(
        cluster,
        (operator, ["pool", "claim", pool, "--group", trainer["groupId"], "--claim", "gpus-c"]),
        (operator, ["pool", "claim", pool, "--group", other, "--claim", "gpus-c.x-"]),
        (operator, ["pool", "unclaim", pool, "--group", other, "--json"]),
    )
    assert changed.returncode == 0, changed
    assert refused.returncode == 2 and "invalid_argument" in refused.stderr, refused
    assert again.returncode == 0, again
    placed, shown = run_many(
        cluster,
        (job, ["place", pool, "--job", "k8s-a", "--role", "trainer", "--json"]),
        (operator, ["status", "--pool", pool]),
    )
    assert placed.returncode == 0, placed
    (trainer_again,) = json.loads(placed.stdout)["roles"]
    assert (trainer_again["groupId"], trainer_again["claim"]) == (trainer["groupId"], "gpus-c")
    assert shown.returncode == 0, shown
    lines = shown.stdout.splitlines()
    assert any(line.startswith(f"  {trainer['groupId']} (claim gpus-c): ") for line in lines)
    assert any(line.startswith(f"  {other}: expected duty") for line in lines), shown.stdout
