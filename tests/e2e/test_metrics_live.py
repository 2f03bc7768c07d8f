"""The operator's metrics, scraped from live services and parsed with prometheus_client's own
parser: per group (duty cycle, queue depth, hold time, switches, rollbacks, faults), per node
(directive latency, bytes moved, bandwidth), switch phases, and the agent's own series."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import Iterable
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.conftest import ClusterFactory
from timeslice import AsyncTimeSliceClient, register

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "compose" / "grafana" / "dashboards" / "timeslice.json"
STATE_BYTES = 250_000_000
SIM = ["--sim-state-gb", "0.25", "--sim-bandwidth-gbps", "25"]


def scrape(http: str) -> list[Sample]:
    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=5).read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """The one sample called ``name`` whose labels include ``labels``."""
    found = [
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, f"{name} {labels}: {found}"
    return found[0]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    return sum(
        s.value
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


async def test_metrics_answer_operators_questions(cluster_factory: ClusterFactory) -> None:
    cluster = cluster_factory(replicas=2, agents=2, agent_args=SIM)
    sockets = cluster.agent_sockets
    workers = [
        register("g", job_id=job, socket=str(sockets[node])) for job in "ab" for node in sockets
    ]
    try:
        async with (
            AsyncTimeSliceClient(cluster.targets, job_id="a") as a,
            AsyncTimeSliceClient(cluster.targets, job_id="b") as b,
        ):
            await a.acquire("g", timeout=30)
            waiter = asyncio.create_task(b.acquire("g", timeout=30))
            # While b waits, every replica reports a queue of one and a held group.
            async with asyncio.timeout(10):
                while True:
                    scrapes = [scrape(http) for http in cluster.replica_http]
                    if all(
                        total(s, "timeslice_group_queue_depth", group="g") == 1 for s in scrapes
                    ):
                        break
                    await asyncio.sleep(0.1)
            for samples in scrapes:
                assert value(samples, "timeslice_group_held", group="g") == 1
                assert value(samples, "timeslice_group_hold_age_seconds", group="g") > 0
            await asyncio.sleep(0.5)
            await a.yield_("g")
            await waiter
            await asyncio.sleep(0.3)
            await b.yield_("g")
            await asyncio.sleep(0.3)
    finally:
        for w in workers:
            w.close()

    # Each replica hears of b's yield through its etcd watch, a moment after the call returned.
    def settled(samples: list[Sample]) -> bool:
        return (
            total(samples, "timeslice_group_held", group="g") == 0
            and total(samples, "timeslice_hold_seconds_count") == 2
        )

    async with asyncio.timeout(10):
        while not all(settled(scrape(http)) for http in cluster.replica_http):
            await asyncio.sleep(0.1)
    # Group series: every replica watched the same holds, and reports the same figures.
    for http in cluster.replica_http:
        samples = scrape(http)
        duty = value(samples, "timeslice_group_duty_cycle_ratio", group="g")
        # Over the time the replica watched (it started before the jobs came): held for a
        # part of it, free at its end (the window's arithmetic: tests/unit/test_holds.py).
        assert 0.0 < duty < 1.0, duty
        assert value(samples, "timeslice_group_held", group="g") == 0
        assert value(samples, "timeslice_group_queue_depth", group="g") == 0
        assert value(samples, "timeslice_group_held_seconds_total", group="g") > 0.6
        # Cluster-wide counters from the group's stats record in etcd.
        assert value(samples, "timeslice_group_grants_total", group="g") == 2
        assert value(samples, "timeslice_group_switches_total", group="g") == 2
        assert value(samples, "timeslice_group_rollbacks_total", group="g") == 0
        assert value(samples, "timeslice_group_faults_total", group="g") == 0
        assert value(samples, "timeslice_group_last_switch_seconds", group="g") > 0
        # Acquire wait per group, from the grants' holder records: a's (at once) and b's
        # (behind a for over half a second).
        assert value(samples, "timeslice_group_acquire_waits", group="g") == 2
        p50, p99 = (
            value(samples, "timeslice_group_acquire_wait_seconds", group="g", quantile=q)
            for q in ("0.5", "0.99")
        )
        assert p50 < 0.5 <= p99 < 30, (p50, p99)
        # Holds: a's and b's.
        assert value(samples, "timeslice_hold_seconds_count") == 2
        assert value(samples, "timeslice_hold_seconds_sum") > 0.6
        assert value(samples, "timeslice_group_series_omitted") == 0

    # Per node and per phase, from the replica that drove the switches.
    replicas = [scrape(http) for http in cluster.replica_http]
    # The hot path's etcd transactions (two holds: an acquire and a yield each, at least) and
    # the requests that carried them (store/batch.py): never more requests than transactions.
    txns = sum(total(s, "timeslice_etcd_batched_txns_total") for s in replicas)
    requests = sum(total(s, "timeslice_etcd_batch_requests_total") for s in replicas)
    assert txns >= 4 and 0 < requests <= txns, (txns, requests)
    nodes = sorted(sockets)
    for node in nodes:
        moved = sum(
            total(s, "timeslice_node_moved_bytes_total", node=node, kind="checkpoint")
            for s in replicas
        )
        assert moved == STATE_BYTES  # a's state, checkpointed once on each node
        seconds = sum(
            total(s, "timeslice_node_transfer_seconds_total", node=node, kind="checkpoint")
            for s in replicas
        )
        assert seconds > 0
        latency = sum(
            total(s, "timeslice_directive_seconds_count", node=node, kind="restore")
            for s in replicas
        )
        assert latency == 2  # a restored, then b
    phases = {
        phase: sum(total(s, "timeslice_switch_phase_seconds_count", phase=phase) for s in replicas)
        for phase in ("checkpoint", "restore", "commit")
    }
    assert phases == {"checkpoint": 2, "restore": 2, "commit": 2}, phases

    # The agent's own series.
    exported = {s.name for samples in replicas for s in samples}
    for node, http in cluster.agent_http.items():
        samples = scrape(http)
        exported |= {s.name for s in samples}
        moved = total(samples, "timeslice_agent_bytes_moved_total", kind="checkpoint")
        assert moved == STATE_BYTES, node
        assert total(samples, "timeslice_agent_transfer_seconds_total", kind="checkpoint") > 0
        rate = total(samples, "timeslice_agent_last_transfer_bytes_per_second", kind="checkpoint")
        assert rate > 0
        assert total(samples, "timeslice_agent_directive_seconds_count", kind="restore") == 2

    # Every series the shipped Grafana dashboard queries is one the live services export.
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\btimeslice_[a-z_]+", target["expr"])
    }
    assert queried, "the dashboard queries timeslice series"
    assert queried <= exported, sorted(queried - exported)


def test_compose_prometheus_scrapes_every_service_on_its_http_port() -> None:
    compose = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())
    services = compose["services"]
    scrape_config = yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text())
    targets = {
        target
        for job in scrape_config["scrape_configs"]
        for static in job["static_configs"]
        for target in static["targets"]
    }
    expected = set()
    for name, service in services.items():
        command = [str(a) for a in service.get("command", [])]
        if "--http" in command and command[0] in ("orchestrator", "agent"):
            port = command[command.index("--http") + 1].rsplit(":", 1)[1]
            expected.add(f"{name}:{port}")
    assert targets == expected
    grafana = services["grafana"]
    mounts = " ".join(grafana["volumes"])
    assert "./grafana/dashboards:/var/lib/grafana/dashboards" in mounts
    assert (ROOT / "compose" / "grafana" / "provisioning" / "dashboards").is_dir()
