"""Prometheus metrics of one orchestrator replica (served on /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.grants = Counter("timeslice_grants", "Grants made", ["kind"], registry=r)
        self.switches = Counter(
            "timeslice_switches", "Context switches by outcome", ["outcome"], registry=r
        )
        self.switch_seconds = Histogram(
            "timeslice_switch_seconds",
            "Wall time of a context switch, checkpoint to commit",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.acquire_wait_seconds = Histogram(
            "timeslice_acquire_wait_seconds",
            "Time from Acquire to grant",
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60, 300),
        )
        self.directives = Counter(
            "timeslice_directives",
            "Directives sent, by kind and ack status",
            ["kind", "status"],
            registry=r,
        )
        self.agents_connected = Gauge(
            "timeslice_agents_connected", "Agent streams held by this replica", registry=r
        )
        self.agents_fenced = Counter(
            "timeslice_agents_fenced",
            "Nodes this replica fenced out of their groups, by why",
            ["reason"],
            registry=r,
        )
        self.waiters = Gauge(
            "timeslice_waiters", "Acquire calls waiting on this replica", registry=r
        )
        self.rpc_errors = Counter(
            "timeslice_rpc_errors",
            "Client API calls that ended in a typed error",
            ["kind"],
            registry=r,
        )
        self.authz_refusals = Counter(
            "timeslice_authz_refusals",
            "Client API calls refused for who made them (a session's secret missing or wrong, "
            "an operator RPC without an operator identity), by RPC and cause",
            ["rpc", "cause"],
            registry=r,
        )
        self.replica_terms = Counter(
            "timeslice_replica_terms",
            "Terms of this replica: one at start, one more each time it rejoins after losing "
            "its lease",
            registry=r,
        )
        self.tls_refusals = Counter(
            "timeslice_tls_refusals",
            "TLS handshakes this replica refused (no, unknown or expired client certificate)",
            ["reason"],
            registry=r,
        )
        self.driver_errors = Counter(
            "timeslice_driver_errors", "Unexpected errors in the switch driver", registry=r
        )
        self.idle_groups_removed = Counter(
            "timeslice_idle_groups_removed",
            "Groups this replica removed after they stayed idle for the idle-group TTL",
            registry=r,
        )
        self.admission = Counter(
            "timeslice_admission",
            "Client calls that found their connection's token bucket empty: waited, or refused "
            "(too many waiting, or no tokens within --client-max-wait)",
            ["outcome"],
            registry=r,
        )
        self.groups = Gauge("timeslice_groups", "Groups in this replica's mirror", registry=r)
