"""Prometheus metrics of one orchestrator replica (served on /metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from timeslice_orchestrator.store.batch import TxnBatcher
from timeslice_orchestrator.store.records import FeaturesRecord


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.grants = Counter("timeslice_grants", "Grants made", ["kind"], registry=r)
        self.hand_overs = Counter(
            "timeslice_hand_overs",
            "Yields that granted the next waiter in place, by etcd transactions taken (one "
            "where the deployment's features allow it, else two)",
            ["transactions"],
            registry=r,
        )
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
        # Exported at 0: alerts see a series from start.
        for reason in ("deadline", "silent", "unwritable"):
            self.agents_fenced.labels(reason=reason)
        self.waiters = Gauge(
            "timeslice_waiters", "Acquire calls waiting on this replica", registry=r
        )
        self.yield_streams = Gauge(
            "timeslice_yield_streams",
            "YieldStreams open on this replica (an SDK keeps one per connection, its yields "
            "each a message; counted with Yield calls in rpc errors and refusals)",
            registry=r,
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
        # The gRPC port's connections (tls.py; with TLS only): what unauthenticated and idle
        # peers hold, and what was shed to bound it.
        self.pending_handshakes = Gauge(
            "timeslice_pending_handshakes",
            "Connections accepted whose TLS handshake is not done yet (--max-pending-handshakes)",
            registry=r,
        )
        self.tls_connections = Gauge(
            "timeslice_tls_connections",
            "Connections past their TLS handshake, handed to gRPC",
            registry=r,
        )
        self.connections_closed = Counter(
            "timeslice_connections_closed",
            "Connections the replica closed to bound what peers hold, by why: address_cap (too "
            "many handshakes pending from its address), evicted (the oldest silent one, with "
            "--max-pending-handshakes reached), identity_cap (its certificate's identity "
            "already had --max-connections-per-identity), idle (no call for "
            "--idle-connection-timeout)",
            ["reason"],
            registry=r,
        )
        for reason in ("address_cap", "evicted", "identity_cap", "idle"):
            self.connections_closed.labels(reason=reason)
        self.accept_pauses = Counter(
            "timeslice_accept_pauses",
            "Times the replica stopped accepting connections for a while (every pending one "
            "in its handshake at --max-pending-handshakes, or out of file descriptors)",
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
        # Per group: see group_metrics.py (a collector over the mirror, registered by the app).
        self.hold_seconds = Histogram(
            "timeslice_hold_seconds",
            "Length of each hold, grant to release (every replica sees every hold)",
            registry=r,
            buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600),
        )
        self.switch_phase_seconds = Histogram(
            "timeslice_switch_phase_seconds",
            "Wall time of each phase of the switches this replica drove: checkpoint (every "
            "node), restore (every node), rollback, commit (the etcd transaction)",
            ["phase"],
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        # Per node, from the directives this replica sent and their acks.
        self.directive_seconds = Histogram(
            "timeslice_directive_seconds",
            "Directive round trip, sent to ack, by node and kind",
            ["node", "kind"],
            registry=r,
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
        )
        self.node_bytes_moved = Counter(
            "timeslice_node_moved_bytes",
            "Bytes the node's agent reported moved, by kind (modelled by emulated backends)",
            ["node", "kind"],
            registry=r,
        )
        self.node_bytes_skipped = Counter(
            "timeslice_node_skipped_bytes",
            "Of moved_bytes: bytes the node's agent released without a copy because the host "
            "copy was still current, by kind",
            ["node", "kind"],
            registry=r,
        )
        self.node_transfer_seconds = Counter(
            "timeslice_node_transfer_seconds",
            "Backend seconds of the directives that copied bytes, by node and kind: "
            "rate(moved_bytes - skipped_bytes) / rate(transfer_seconds) is the node's bandwidth",
            ["node", "kind"],
            registry=r,
        )
        self.node_transfer_rate = Gauge(
            "timeslice_node_last_transfer_bytes_per_second",
            "Bandwidth of the node's last directive that copied bytes (skipped ones not "
            "counted), by kind",
            ["node", "kind"],
            registry=r,
        )


class BatchMetrics(Collector):
    """How much the hot path's etcd transactions share requests (store/batch.py): their
    ratio is the transactions per request."""

    def __init__(self, batcher: TxnBatcher) -> None:
        self._batcher = batcher

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "timeslice_etcd_batched_txns",
            "Hot-path etcd transactions (enqueue, grant, release) sent by this replica",
            value=self._batcher.txns_sent,
        )
        yield CounterMetricFamily(
            "timeslice_etcd_batch_requests",
            "etcd requests that carried them: one per transaction when nothing queues",
            value=self._batcher.requests_sent,
        )


class FeatureMetrics(Collector):
    """The deployment's features record as this replica's mirror sees it (store.handover):
    after ``timeslice orchestrator features enable``, each replica shows it here."""

    def __init__(self, features: Callable[[], FeaturesRecord | None]) -> None:
        self._features = features

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "timeslice_feature_enabled",
            "1 when the deployment's features record, as this replica sees it, turns it on",
            labels=["feature"],
        )
        record = self._features() or FeaturesRecord()
        for name, on in record.switches().items():
            family.add_metric([name], 1.0 if on else 0.0)
        yield family
