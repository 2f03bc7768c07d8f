"""Prometheus metrics of one agent process, in a registry of its own.

Names start with ``timeslice_agent_``. Series whose numbers may be modelled rather than measured
(bytes moved, directive time) carry ``backend`` and ``emulated`` labels so a dashboard can never
mix sim results with real ones; ``timeslice_agent_info`` says the same for the whole process.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from timeslice_agent import __version__
from timeslice_agent.jobs import JobState
from timeslice_agent.peers import REFUSAL_REASONS

_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class AgentMetrics:
    """Every metric the agent exports."""

    def __init__(self, *, node: str, backend: str, emulated: bool, mechanism: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._backend = backend
        self._emulated = "true" if emulated else "false"
        r = self.registry
        self.info = Gauge(
            "timeslice_agent_info",
            "Constant 1; labels describe this agent (mechanism: the path the backend runs, "
            "driver-api or cli for cuda; discovery: nvml, procfs or off).",
            ["node", "backend", "emulated", "version", "mechanism", "discovery"],
            registry=r,
        )
        self._node = node
        self.describe(mechanism or backend, "off")
        self.directives = Counter(
            "timeslice_agent_directives",
            "Directives answered, by kind and ack status.",
            ["kind", "status"],
            registry=r,
        )
        self.directive_seconds = Histogram(
            "timeslice_agent_directive_seconds",
            "Time from receiving a directive to its ack.",
            ["kind", "backend", "emulated"],
            buckets=_BUCKETS,
            registry=r,
        )
        self.bytes_moved = Counter(
            "timeslice_agent_bytes_moved",
            "Bytes moved off or onto the device by directives (modelled when emulated=true); "
            "bytes_skipped of them were not copied.",
            ["kind", "backend", "emulated"],
            registry=r,
        )
        self.bytes_skipped = Counter(
            "timeslice_agent_bytes_skipped",
            "Of bytes_moved: bytes released without a copy because the host copy was still "
            "current (app hooks with TorchOffloader keep_pinned).",
            ["kind", "backend", "emulated"],
            registry=r,
        )
        self.transfer_seconds = Counter(
            "timeslice_agent_transfer_seconds",
            "Seconds of the directives that moved bytes: rate(bytes_moved - bytes_skipped) / "
            "rate(transfer_seconds) is this node's bandwidth.",
            ["kind", "backend", "emulated"],
            registry=r,
        )
        self.transfer_rate = Gauge(
            "timeslice_agent_last_transfer_bytes_per_second",
            "Bandwidth of the last directive that copied bytes, skipped bytes not counted "
            "(modelled when emulated=true).",
            ["kind", "backend", "emulated"],
            registry=r,
        )
        self.refused = Counter(
            "timeslice_agent_directives_refused",
            "Directives refused without acting, by reason (stale_epoch, backend, invalid).",
            ["reason"],
            registry=r,
        )
        self.registrations_refused = Counter(
            "timeslice_agent_registrations_refused",
            "Worker registrations refused, by reason (not_descendant, foreign_uid, namespace, "
            "...; timeslice_agent.peers.REFUSAL_REASONS).",
            ["reason"],
            registry=r,
        )
        for reason in REFUSAL_REASONS:
            self.registrations_refused.labels(reason)
        self.registered_workers = Gauge(
            "timeslice_agent_registered_workers",
            "Worker registrations currently live on this node.",
            registry=r,
        )
        self.stream_connected = Gauge(
            "timeslice_agent_stream_connected",
            "1 while the stream to an orchestrator is up and welcomed.",
            registry=r,
        )
        self.jobs = Gauge(
            "timeslice_agent_jobs",
            "Jobs known on this node, by state.",
            ["state"],
            registry=r,
        )
        self.state_write_failures = Counter(
            "timeslice_agent_state_write_failures",
            "State-file writes that failed since start.",
            registry=r,
        )
        self.task_failures = Counter(
            "timeslice_agent_task_failures",
            "Background tasks that ended with an unexpected error, by task name.",
            ["task"],
            registry=r,
        )
        self.reconnects = Counter(
            "timeslice_agent_stream_reconnects",
            "Stream attempts that failed or ended and were retried.",
            registry=r,
        )
        for state in JobState:
            self.jobs.labels(state.value).set(0)
        self.refused.labels("stale_epoch")

    def describe(self, mechanism: str, discovery: str) -> None:
        """(Re)label ``timeslice_agent_info`` once the backend path and discovery are known."""
        self.info.clear()
        self.info.labels(
            self._node, self._backend, self._emulated, __version__, mechanism, discovery
        ).set(1)

    def observe_directive(
        self, kind: str, status: str, seconds: float, nbytes: int, skipped: int = 0
    ) -> None:
        """Record one answered directive: ``nbytes`` moved, ``skipped`` of them not copied."""
        self.directives.labels(kind, status).inc()
        labels = (kind, self._backend, self._emulated)
        self.directive_seconds.labels(*labels).observe(seconds)
        if nbytes:
            self.bytes_moved.labels(*labels).inc(nbytes)
            if skipped:
                self.bytes_skipped.labels(*labels).inc(skipped)
            copied = nbytes - skipped
            if seconds > 0 and copied > 0:
                self.transfer_seconds.labels(*labels).inc(seconds)
                self.transfer_rate.labels(*labels).set(copied / seconds)

    def set_jobs(self, states: Iterable[JobState]) -> None:
        """Refresh the per-state job gauge from the current job table."""
        counts = dict.fromkeys(JobState, 0)
        for state in states:
            counts[state] += 1
        for state, count in counts.items():
            self.jobs.labels(state.value).set(count)

    def render(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
