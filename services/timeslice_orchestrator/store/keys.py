"""The etcd key layout of one deployment (DESIGN.md section 3), both ways.

Every key lives under ``<prefix>/``. :class:`Keyspace` builds the keys the transactions write
and parses the keys the mirror reads back into a :class:`KeyRef`, so no other module spells a
key or splits one. IDs are validated before they become key parts, so a key can always be
split back into its parts.

    sessions/<session>                 a client session, attached to its lease
    agents/<node>                      a node agent and its workers, attached to an agent lease
    relay/<node>/<directive>           a directive relayed to the replica holding <node>'s stream
    fences/<node>                      the node was fenced out; its mod revision is the floor of
                                       the epochs it may act on (not mirrored: read on hello)
    nodes/<node>                       an agent for the node connected once: only such nodes
                                       can be pinned (not mirrored: read by SetGroupMembers)
    beacon                             written by a replica to see its watch bring it back
                                       (not state: its value is the last writer's ID)
    features                           what the replicas may do that older ones would misread
    groups/<group>/meta                marks the group as existing
    groups/<group>/queue/<job>         a waiter, attached to its session; FIFO by create revision
    groups/<group>/holder              the hold; its create revision is the fencing epoch, or
                                       the revision of the hand-over that wrote it (hold_epoch)
    groups/<group>/resident            whose device state is on which node
    groups/<group>/switch              a switch in progress; its create revision is its epoch
    groups/<group>/driver              the replica driving the group, attached to its lease
    groups/<group>/members             nodes an operator pinned to the group
    groups/<group>/usage               accelerator time per job
    groups/<group>/stats               counters and the last error
    groups/<group>/faulted/<job>       why a waiter was given up on, attached to its session
    groups/<group>/operations/<id>     an operator snapshot / restore of one job on one node,
                                       attached to its own lease (the retention)
    pools/<pool>/config                a placement pool: its groups, cap and operator rules
                                       (not mirrored: read and written by store/pools.py)
    pools/<pool>/assignments           every job's role -> group in the pool, one key so that
                                       one compare covers the pool's load
    pools/<pool>/audit                 the pool's last placements and rule changes (bounded)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Kind(enum.Enum):
    """What a key holds."""

    SESSION = "sessions"
    AGENT = "agents"
    RELAY = "relay"
    META = "meta"
    QUEUE = "queue"
    HOLDER = "holder"
    RESIDENT = "resident"
    SWITCH = "switch"
    DRIVER = "driver"
    MEMBERS = "members"
    USAGE = "usage"
    STATS = "stats"
    FAULT = "faulted"
    OPERATION = "operations"
    FEATURES = "features"
    OTHER = "other"  # a key of a group this version does not know: it still makes the group exist


# The keys a group has one of, by their name under ``groups/<group>/``.
_SINGLE = {
    k.value: k
    for k in (
        Kind.META,
        Kind.HOLDER,
        Kind.RESIDENT,
        Kind.SWITCH,
        Kind.DRIVER,
        Kind.MEMBERS,
        Kind.USAGE,
        Kind.STATS,
    )
}
# The keys a group has one of per job, by their folder under ``groups/<group>/``.
# (An operation's key is named by its id, not a job: the same shape.)
_PER_JOB = {
    Kind.QUEUE.value: Kind.QUEUE,
    Kind.FAULT.value: Kind.FAULT,
    Kind.OPERATION.value: Kind.OPERATION,
}


@dataclass(frozen=True, slots=True)
class KeyRef:
    """A parsed key: its kind and the IDs in it (hashable: the mirror indexes by it)."""

    kind: Kind
    group: str = ""  # the group of a ``groups/`` key
    name: str = ""  # session ID, node, the job of a queue entry or fault record, operation ID
    directive: str = ""  # the directive ID of a relay key

    @property
    def topic(self) -> str:
        """What a change of this key wakes: ``group:<g>``, ``sessions``, ``agents`` or ``relay``."""
        return group_topic(self.group) if self.group else self.kind.value


def group_topic(group: str) -> str:
    """The notification topic of every key of ``group``."""
    return f"group:{group}"


@dataclass(frozen=True, slots=True)
class Keyspace:
    """The keys of one deployment, all under ``prefix`` (for example ``/timeslice/default``)."""

    prefix: str
    # Built once: parse() reads it for every key of a listing (400,000 at 100,000 groups).
    _root: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ValueError(f"prefix must start with '/' and not end with it: {self.prefix!r}")
        object.__setattr__(self, "_root", f"{self.prefix}/".encode())

    @property
    def root(self) -> bytes:
        """The prefix every key of the deployment starts with (what the mirror watches)."""
        return self._root

    def _k(self, *parts: str) -> bytes:
        return "/".join((self.prefix, *parts)).encode()

    def parse(self, key: bytes) -> KeyRef | None:
        """What ``key`` is, or None for a key outside the layout (a foreign writer's)."""
        root = self._root
        if not key.startswith(root):
            return None
        try:
            parts = key[len(root) :].decode().split("/")
        except UnicodeDecodeError:
            return None  # every key of ours is UTF-8: someone else wrote this one
        match parts:
            case ["sessions", session_id]:
                return KeyRef(Kind.SESSION, name=session_id)
            case ["agents", node]:
                return KeyRef(Kind.AGENT, name=node)
            case ["features"]:
                return KeyRef(Kind.FEATURES)
            case ["relay", node, directive_id]:
                return KeyRef(Kind.RELAY, name=node, directive=directive_id)
            case ["groups", group, name] if name in _SINGLE:
                return KeyRef(_SINGLE[name], group)
            case ["groups", group, folder, job] if folder in _PER_JOB:
                return KeyRef(_PER_JOB[folder], group, job)
            case ["groups", group, *_]:
                return KeyRef(Kind.OTHER, group)
        return None

    # -- sessions, agents, relay ------------------------------------------------------------

    def session(self, session_id: str) -> bytes:
        return self._k("sessions", session_id)

    def agent(self, node: str) -> bytes:
        return self._k("agents", node)

    def relay(self, node: str, directive_id: str) -> bytes:
        return self._k("relay", node, directive_id)

    def fence(self, node: str) -> bytes:
        return self._k("fences", node)

    def beacon(self) -> bytes:
        """One key every replica writes to see its own write come back through its watch
        (``Mirror.catch_up``: on rejoin, and when the watch has been quiet); outside the
        layout the mirror reads."""
        return self._k("beacon")

    def features(self) -> bytes:
        return self._k("features")

    def known_node(self, node: str) -> bytes:
        return self._k("nodes", node)

    # -- placement pools (docs/placement.md) ---------------------------------------------------

    def pools(self) -> bytes:
        """The prefix of every pool's keys."""
        return self._k("pools", "")

    def pool_root(self, pool: str) -> bytes:
        """The prefix of every key of ``pool``."""
        return self._k("pools", pool, "")

    def pool_config(self, pool: str) -> bytes:
        return self._k("pools", pool, "config")

    def pool_assignments(self, pool: str) -> bytes:
        return self._k("pools", pool, "assignments")

    def pool_audit(self, pool: str) -> bytes:
        return self._k("pools", pool, "audit")

    # -- groups -----------------------------------------------------------------------------

    def groups(self) -> bytes:
        """The prefix of every group's keys."""
        return self._k("groups", "")

    # -- one group --------------------------------------------------------------------------

    def group_root(self, group: str) -> bytes:
        """The prefix of every key of ``group`` (what removing an idle group deletes)."""
        return self._k("groups", group, "")

    def meta(self, group: str) -> bytes:
        return self._k("groups", group, "meta")

    def queue(self, group: str) -> bytes:
        """The prefix of the group's queue entries."""
        return self._k("groups", group, "queue", "")

    def queue_entry(self, group: str, job: str) -> bytes:
        return self._k("groups", group, "queue", job)

    def holder(self, group: str) -> bytes:
        return self._k("groups", group, "holder")

    def resident(self, group: str) -> bytes:
        return self._k("groups", group, "resident")

    def switch(self, group: str) -> bytes:
        return self._k("groups", group, "switch")

    def driver(self, group: str) -> bytes:
        return self._k("groups", group, "driver")

    def members(self, group: str) -> bytes:
        return self._k("groups", group, "members")

    def usage(self, group: str) -> bytes:
        return self._k("groups", group, "usage")

    def stats(self, group: str) -> bytes:
        return self._k("groups", group, "stats")

    def fault(self, group: str, job: str) -> bytes:
        return self._k("groups", group, "faulted", job)

    def operation(self, group: str, operation_id: str) -> bytes:
        return self._k("groups", group, "operations", operation_id)
