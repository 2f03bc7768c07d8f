"""Sending one phase of a switch to its nodes, concurrently, and gathering every node's outcome.

A directive's id is fixed by (switch, purpose, node, job), so a driver that carries on a switch
after a crash re-sends the same ids and agents answer what they already did instead of doing it
twice. Every outcome comes back as a NodeResult, never as an exception: the driver decides.

A node that misses a directive's deadline is fenced out (``docs/fencing.md``) and reported
``gone``: the switch goes on without it. A node the switch record lists as fenced is not sent
anything again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from opentelemetry.trace import SpanKind, StatusCode, Tracer

from timeslice.tracing import carrier_of
from timeslice_orchestrator.hub import AgentFenced, AgentGone, AgentTimeout, AgentUnavailable
from timeslice_orchestrator.metrics import Metrics
from timeslice_orchestrator.relay import DirectiveRouter
from timeslice_orchestrator.store.etcd import StoreUnavailable
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.records import NodeStep, Stored, SwitchRecord
from timeslice_proto.timeslice.v1 import (
    AckStatus,
    Directive,
    DirectiveAck,
    DirectiveKind,
    StaleCause,
)

# Purposes whose directive acts on the step's evicted job (the others act on the restored one).
_ON_EVICTED = ("evict", "rollback")
# The switch phase a fan-out is, as timeslice_switch_phase_seconds names it.
_PHASE_OF_PURPOSE = {"evict": "checkpoint"}


@dataclass(frozen=True, slots=True)
class NodeResult:
    """One node's answer to one directive."""

    node: str
    ok: bool
    error: str
    bytes_moved: int
    elapsed: float
    unavailable: bool = False  # the agent could not be reached: the outcome is unknown
    gone: bool = False  # the node left its groups (agent record expired): not waited for
    fenced: bool = False  # gone because it was fenced out (silent, or a missed deadline)
    # The agent moved the job's state; an OK with nothing to do (the restore of a job never
    # checkpointed) did not. Agents before this field say it only by the bytes they moved.
    moved: bool = False
    refused: bool = False  # the agent refused before acting (admission, safety), not failed

    @property
    def failed(self) -> bool:
        """A real failure: the node answered no, or did not answer by the deadline."""
        return not self.ok and not self.gone


class DirectiveSender:
    """Sends switch directives through the router and reports, traces and counts them."""

    def __init__(
        self,
        router: DirectiveRouter,
        mirror: Mirror,
        metrics: Metrics,
        tracer: Tracer,
        timeout: float,
    ) -> None:
        self._router = router
        self._mirror = mirror
        self._metrics = metrics
        self._tracer = tracer
        self._timeout = timeout

    async def fan_out(
        self,
        switch: Stored[SwitchRecord],
        kind: DirectiveKind,
        steps: list[NodeStep],
        purpose: str,
    ) -> list[NodeResult]:
        """Send one directive per step concurrently; the results are in ``steps``' order."""
        with self._tracer.start_as_current_span(
            f"timeslice.{purpose}",
            attributes={"timeslice.group": switch.record.group, "timeslice.nodes": len(steps)},
        ) as span:
            started = time.monotonic()
            # Every step runs to its end (each is bounded by the directive deadline) before
            # an error of one (etcd away while relaying) is raised: none is left running
            # unwatched behind the driver's back, and the driver's retry re-sends the same
            # directive ids, which the agents answer from their ledgers.
            outcomes = await asyncio.gather(
                *(self._run_step(switch, kind, s, purpose) for s in steps),
                return_exceptions=True,
            )
            results: list[NodeResult] = []
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
                results.append(outcome)
            phase = _PHASE_OF_PURPOSE.get(purpose, purpose)
            self._metrics.switch_phase_seconds.labels(phase=phase).observe(
                time.monotonic() - started
            )
            failed = [r.node for r in results if not r.ok]
            if failed:
                span.set_status(StatusCode.ERROR, f"failed on {', '.join(failed)}")
            return results

    async def _run_step(
        self, switch: Stored[SwitchRecord], kind: DirectiveKind, step: NodeStep, purpose: str
    ) -> NodeResult:
        job = step.evict if purpose in _ON_EVICTED else step.restore
        if step.node in switch.record.fenced:
            error = f"node {step.node} was fenced out earlier in this switch"
            return NodeResult(step.node, False, error, 0, 0.0, gone=True, fenced=True)
        agent = self._mirror.agents().get(step.node)
        # One operation name for every node (the node is an attribute), so a tracing UI
        # groups the directives of all nodes; distinct from the phase span above it.
        with self._tracer.start_as_current_span(
            f"timeslice.{purpose}.node",
            kind=SpanKind.CLIENT,
            attributes={
                "timeslice.group": switch.record.group,
                "timeslice.node": step.node,
                "timeslice.job": job,
                "timeslice.epoch": switch.create_revision,
                "timeslice.directive": kind.name.lower(),
                "timeslice.backend": agent.backend if agent else "",
                "timeslice.emulated": bool(agent and agent.emulated),
            },
        ) as span:
            directive = Directive(
                directive_id=f"{switch.record.switch_id}-{purpose}-{step.node}-{job}",
                group_id=switch.record.group,
                epoch=switch.create_revision,
                kind=kind,
                job_id=job,
                deadline_ms=int(self._timeout * 1000),
                trace_context=carrier_of(span),
            )
            result = await self._execute(step.node, directive, kind)
            span.set_attributes(
                {
                    "timeslice.bytes_moved": result.bytes_moved,
                    "timeslice.backend_seconds": result.elapsed,
                }
            )
            if not result.ok:
                span.set_status(StatusCode.ERROR, result.error)
            return result

    def _observe(self, node: str, kind: str, round_trip: float, ack: DirectiveAck) -> None:
        metrics = self._metrics
        metrics.directive_seconds.labels(node=node, kind=kind).observe(round_trip)
        if ack.bytes_moved > 0:
            metrics.node_bytes_moved.labels(node=node, kind=kind).inc(ack.bytes_moved)
            skipped = min(ack.bytes_skipped, ack.bytes_moved)
            if skipped:
                metrics.node_bytes_skipped.labels(node=node, kind=kind).inc(skipped)
            copied = ack.bytes_moved - skipped
            if copied > 0 and ack.elapsed_seconds > 0:
                metrics.node_transfer_seconds.labels(node=node, kind=kind).inc(ack.elapsed_seconds)
                rate = copied / ack.elapsed_seconds
                metrics.node_transfer_rate.labels(node=node, kind=kind).set(rate)

    async def _execute(self, node: str, directive: Directive, kind: DirectiveKind) -> NodeResult:
        started = time.monotonic()
        label = kind.name.lower()
        try:
            # A second of grace past the deadline the agent works to, for its ack to come back.
            ack = await self._router.execute(node, directive, self._timeout + 1)
        except AgentTimeout as exc:
            # Connected but silent past the deadline: fenced out, so that the switch goes on
            # without it and nothing it was sent can act once it rejoins.
            self._metrics.directives.labels(kind=label, status="timeout").inc()
            reason = f"missed the deadline of {directive.directive_id}: {exc}"
            try:
                await self._router.fence(node, reason)
            except StoreUnavailable as fence_error:
                # Neither done nor fenced: the directive may still act on the node. Outcome
                # unknown, like an unreachable agent: the driver keeps the switch and sends the
                # same directive again (rolling back now would race it).
                error = f"{exc}; fencing it out failed: {fence_error}"
                return NodeResult(
                    node, False, error, 0, time.monotonic() - started, unavailable=True
                )
            self._metrics.agents_fenced.labels(reason="deadline").inc()
            error = f"fenced out: {reason}"
            return NodeResult(
                node, False, error, 0, time.monotonic() - started, gone=True, fenced=True
            )
        except AgentFenced as exc:
            self._metrics.directives.labels(kind=label, status="fenced").inc()
            return NodeResult(
                node, False, str(exc), 0, time.monotonic() - started, gone=True, fenced=True
            )
        except AgentGone as exc:
            # Final: the node left its groups; whatever it held is no longer counted on.
            self._metrics.directives.labels(kind=label, status="gone").inc()
            return NodeResult(node, False, str(exc), 0, time.monotonic() - started, gone=True)
        except AgentUnavailable as exc:
            # Not reached, or the stream broke before the ack: the outcome is unknown.
            self._metrics.directives.labels(kind=label, status="unavailable").inc()
            return NodeResult(
                node, False, str(exc), 0, time.monotonic() - started, unavailable=True
            )
        self._metrics.directives.labels(kind=label, status=ack.status.name.lower()).inc()
        self._observe(node, label, time.monotonic() - started, ack)
        ok = ack.status == AckStatus.OK
        error = "" if ok else f"{ack.status.name.lower()}: {ack.error}"
        if ack.status == AckStatus.STALE_EPOCH and ack.stale_cause == StaleCause.NODE_FENCED:
            # The node was fenced out since this switch began (by another replica, say):
            # nothing of this switch may act there; go on without it. Read from the typed
            # cause only: the error text is for people and may be worded any way.
            return NodeResult(node, False, error, 0, ack.elapsed_seconds, gone=True, fenced=True)
        moved = ok and (ack.moved or ack.bytes_moved > 0)
        refused = ack.status == AckStatus.REFUSED
        return NodeResult(
            node, ok, error, ack.bytes_moved, ack.elapsed_seconds, moved=moved, refused=refused
        )
