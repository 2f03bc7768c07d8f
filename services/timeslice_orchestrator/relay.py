"""Directive routing across replicas.

The replica that drives a group is not always the one holding a node agent's stream (agents
dial any replica). Directives then travel through etcd: the driver posts
``relay/<node>/<id>`` (attached to its own lease, so it vanishes if the driver dies), the stream
holder sees it in its mirror, executes it over the stream and writes the ack into the same key,
and the driver, watching its mirror too, picks the ack up and deletes the key. Cost: about two
etcd writes and two watch deliveries (a few milliseconds on loopback) only for cross-replica
directives; local ones go straight down the stream.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging

from timeslice.backoff import Backoff
from timeslice_orchestrator.hub import AgentGone, AgentHub, AgentTimeout, AgentUnavailable
from timeslice_orchestrator.store.etcd import StoreUnavailable
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.mirror import RELAY_TOPIC
from timeslice_orchestrator.store.records import RelayRecord
from timeslice_orchestrator.store.relay import RelayStore
from timeslice_proto.timeslice.v1 import Directive, DirectiveAck

log = logging.getLogger(__name__)


def _encode(message: Directive | DirectiveAck) -> str:
    return base64.b64encode(bytes(message)).decode()


class DirectiveRouter:
    def __init__(
        self, hub: AgentHub, mirror: Mirror, relay: RelayStore, replica_id: str, lease: int
    ) -> None:
        self._hub = hub
        self._mirror = mirror
        self._relay = relay
        self._replica_id = replica_id
        self._lease = lease
        self._forwarding: dict[str, asyncio.Task[None]] = {}

    def start(self) -> None:
        self._mirror.add_listener(self._on_change)
        self._hub.fencer = self.fence
        # Posts made before this router started (while this replica rejoined, its previous
        # router gone) are waiting for us already: no change will announce them again.
        self._on_change({RELAY_TOPIC})

    async def fence(self, node: str, reason: str) -> None:
        """Fence ``node`` out of every group (``docs/fencing.md``), whichever replica holds it.

        Its residency is marked unknown wherever it is listed; the replica holding its stream
        closes it (here at once, elsewhere when the revoked agent lease is noticed).
        """
        await self._hub.fence(node, reason, self._mirror.groups_resident_on(node))

    async def stop(self) -> None:
        self._mirror.remove_listener(self._on_change)
        for task in self._forwarding.values():
            task.cancel()
        await asyncio.gather(*self._forwarding.values(), return_exceptions=True)

    async def execute(self, node: str, directive: Directive, timeout: float) -> DirectiveAck:
        """Run ``directive`` on ``node``'s agent, wherever its stream is held."""
        if self._hub.holds(node):
            return await self._hub.execute(node, directive, timeout)
        agent = self._mirror.agents().get(node)
        if agent is None:
            raise AgentGone(f"agent {node} is gone (its record expired)")
        record = RelayRecord(driver=self._replica_id, directive=_encode(directive))
        # Whether the post is known to exist: shown by the mirror, or found already there
        # (joined). A known post that the mirror then shows missing was withdrawn unanswered.
        shown = not await self._post(node, directive.directive_id, record)
        try:
            async with asyncio.timeout(timeout):
                while True:
                    seen = self._mirror.version("*")
                    answered = self._mirror.relay(node, directive.directive_id)
                    if answered is not None:
                        shown = True
                        if answered.record.ack:
                            return DirectiveAck.parse(base64.b64decode(answered.record.ack))
                    elif shown:
                        # Gone unanswered: an earlier send of it gave up and removed it, or the
                        # lease it was posted on ended. Post it again.
                        shown = not await self._post(node, directive.directive_id, record)
                    now = self._mirror.agents().get(node)
                    if now is None:
                        # Fenced out, or its record expired: not waited for (like at the start).
                        raise AgentGone(f"agent {node} left its groups (fenced or expired)")
                    if now.replica != agent.replica:
                        # The stream moved (or the agent is gone): whoever holds it now never
                        # saw this post. Report it unreachable; the driver sends it again.
                        raise AgentUnavailable(f"agent {node} left replica {agent.replica}")
                    if now.connected_at != agent.connected_at:
                        # It reconnected to the same replica: that replica failed what was in
                        # flight on the old stream and will not forward this post again. Same
                        # answer as for a local stream that reconnects, not a wait to the
                        # deadline.
                        raise AgentUnavailable(f"agent {node} reconnected to {agent.replica}")
                    await self._mirror.wait_for_change("*", seen)
        except TimeoutError as exc:
            raise AgentTimeout(
                f"agent {node} (via replica {agent.replica}) did not ack within {timeout:.1f} s"
            ) from exc
        finally:
            try:
                await asyncio.shield(self._relay.remove(node, directive.directive_id))
            except StoreUnavailable as exc:
                # It goes with this replica's lease at the latest; forwarders skip answered ones.
                log.warning("could not remove relay key of %s: %s", directive.directive_id, exc)

    async def _post(self, node: str, directive_id: str, record: RelayRecord) -> bool:
        """Post the directive; False when a post of it is there already (then joined)."""
        if not await self._relay.post(node, directive_id, record, self._lease):
            # An earlier send of this very directive (same id, same content), whose pass was
            # cut short (etcd away) or which another driver of the switch made: its ack is
            # this send's answer. Failing here instead would roll the switch back while that
            # send still runs on the agent.
            log.info("directive %s to %s posted already: waiting for its ack", directive_id, node)
            return False
        return True

    def _on_change(self, topics: set[str]) -> None:
        if RELAY_TOPIC not in topics:
            return
        for post in self._mirror.relays():
            node, directive_id, record = post.node, post.directive_id, post.posted.record
            if directive_id in self._forwarding or not self._hub.holds(node):
                continue
            if record.ack or record.driver == self._replica_id:
                continue
            task = asyncio.create_task(
                self._forward(node, directive_id, record), name=f"relay-{node}-{directive_id}"
            )
            self._forwarding[directive_id] = task
            task.add_done_callback(functools.partial(self._forward_done, directive_id))

    def _forward_done(self, directive_id: str, task: asyncio.Task[None]) -> None:
        self._forwarding.pop(directive_id, None)
        if not task.cancelled() and task.exception() is not None:
            log.error("relaying %s failed", directive_id, exc_info=task.exception())

    async def _forward(self, node: str, directive_id: str, record: RelayRecord) -> None:
        directive = Directive.parse(base64.b64decode(record.directive))
        timeout = max(directive.deadline_ms / 1000, 1.0) + 1.0
        try:
            ack = await self._hub.execute(node, directive, timeout)
        except AgentUnavailable as exc:
            log.warning("relayed directive %s to %s not acked: %s", directive_id, node, exc)
            return  # the driver's own deadline reports the failure
        # etcd may be briefly away (a restart): keep trying until the driver's deadline.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        backoff = Backoff(jitter=False)
        while True:
            posted = self._mirror.relay(node, directive_id)
            if posted is None:
                return  # the driver gave up (or the answer landed)
            try:
                await self._relay.answer(node, directive_id, posted, _encode(ack))
                return
            except StoreUnavailable as exc:
                delay = backoff.next_delay()
                if loop.time() + delay > deadline:
                    raise
                log.warning("answering relayed %s: %s; retrying", directive_id, exc)
                await asyncio.sleep(delay)
