"""The etcd key layout of one deployment (DESIGN.md section 3).

Every key lives under ``<prefix>/``; IDs are validated before they become key parts, so a key
can always be split back into its parts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keyspace:
    prefix: str  # for example "/timeslice/default"

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ValueError(f"prefix must start with '/' and not end with it: {self.prefix!r}")

    @property
    def root(self) -> bytes:
        return f"{self.prefix}/".encode()

    def _k(self, rel: str) -> bytes:
        return f"{self.prefix}/{rel}".encode()

    def relative(self, key: bytes) -> str:
        return key.decode()[len(self.prefix) + 1 :]

    def session(self, session_id: str) -> bytes:
        return self._k(f"sessions/{session_id}")

    def group(self, group: str) -> bytes:
        return self._k(f"groups/{group}/")

    def meta(self, group: str) -> bytes:
        return self._k(f"groups/{group}/meta")

    def queue(self, group: str) -> bytes:
        return self._k(f"groups/{group}/queue/")

    def queue_entry(self, group: str, job: str) -> bytes:
        return self._k(f"groups/{group}/queue/{job}")

    def holder(self, group: str) -> bytes:
        return self._k(f"groups/{group}/holder")

    def resident(self, group: str) -> bytes:
        return self._k(f"groups/{group}/resident")

    def switch(self, group: str) -> bytes:
        return self._k(f"groups/{group}/switch")

    def driver(self, group: str) -> bytes:
        return self._k(f"groups/{group}/driver")

    def members(self, group: str) -> bytes:
        return self._k(f"groups/{group}/members")

    def usage(self, group: str) -> bytes:
        return self._k(f"groups/{group}/usage")

    def stats(self, group: str) -> bytes:
        return self._k(f"groups/{group}/stats")

    def fault(self, group: str, job: str) -> bytes:
        return self._k(f"groups/{group}/faulted/{job}")

    def agent(self, node: str) -> bytes:
        return self._k(f"agents/{node}")

    def relay(self, node: str, directive_id: str) -> bytes:
        return self._k(f"relay/{node}/{directive_id}")

    def agents(self) -> bytes:
        return self._k("agents/")


def split_relative(rel: str) -> list[str]:
    return rel.split("/")
