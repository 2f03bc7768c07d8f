"""The store's typed errors: what an etcd call, a watch or a listing can end with."""

from __future__ import annotations


class StoreError(Exception):
    """Base of the store's errors."""


class StoreUnavailable(StoreError):
    """etcd could not be reached or did not answer in time."""


class LeaseExpired(StoreError):
    """The lease no longer exists in etcd."""


class MustRelist(StoreError):
    """A watch or paged listing cannot go on from where it is: the caller lists again."""


class Compacted(MustRelist):
    """A read or watch asked for a revision etcd has compacted away; the caller must re-list."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}")
        self.compact_revision = compact_revision


class WatchCompacted(Compacted):
    """The watch start revision was compacted away; the caller must re-list."""


class EtcdRewound(MustRelist):
    """etcd's revision is behind one already seen from it: it lost writes it had acknowledged
    (restored from an older backup, or a single-member etcd before 3.5.5 / 3.4.21 that crashed
    right after answering, etcd-io/etcd#14370). What was seen of the lost history is wrong
    now, so the caller lists again."""


class WatchTooLarge(MustRelist):
    """A watch response exceeded the receive limit. Resuming would ask for it again, so the
    caller re-lists (paged) past it and watches on from there."""
