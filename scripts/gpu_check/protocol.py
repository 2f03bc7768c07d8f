"""What the check process and its two job processes exchange: a config and a few files.

Files (all in the backend's run directory, written atomically where a reader polls them):

- ``job-<i>.json``: the :class:`JobConfig` of job ``i`` (written by the check);
- ``ready-<i>.json``: job ``i`` registered (the trainer built its state first);
- ``built-<i>.json``: the sampler built its state, inside its first hold;
- ``go.json``: both are ready; holds the pids, so each job knows its peer's;
- ``events-<i>.jsonl``: one line per hold of the group (grant, checks, yield);
- ``finished-<i>.json``: job ``i`` will not acquire again;
- ``result-<i>.json``: how job ``i`` ended (``ok``, ``error``).

Times are wall-clock ``time.time()`` seconds, the clock the agent's journal uses.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

POLL_SECONDS = 0.02


@dataclass(frozen=True)
class JobConfig:
    """Everything a job process needs; serialised to ``job-<i>.json``."""

    index: int
    job_id: str
    peer_job_id: str
    group: str
    backend: str  # "app" or "cuda": how the job registers with the agent
    device: str  # "cuda" or "cpu"
    size_bytes: int
    holds: int
    target: str
    agent_socket: str
    run_dir: str
    deadline: float  # wall clock: the job gives up (and says so) at this time
    keep_pinned: bool  # the trainer's; the sampler always keeps its host copy
    use_nvml: bool
    corrupt_after_restore: bool = False  # the self-test: flip a byte after the first restore

    @property
    def peer_index(self) -> int:
        return 1 - self.index

    def save(self, path: Path) -> None:
        write_json(path, asdict(self))

    @classmethod
    def load(cls, path: Path) -> JobConfig:
        return cls(**json.loads(path.read_text()))


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` so a poller never reads half a file (write, then rename)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def wait_for_file(path: Path, deadline: float) -> bool:
    """Poll until ``path`` exists or the wall-clock ``deadline`` passes."""
    while not path.exists():
        if time.time() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


@dataclass(frozen=True)
class RunFiles:
    """The file names of one backend's run directory."""

    root: Path

    def config(self, index: int) -> Path:
        return self.root / f"job-{index}.json"

    def ready(self, index: int) -> Path:
        return self.root / f"ready-{index}.json"

    def built(self, index: int) -> Path:
        return self.root / f"built-{index}.json"

    def events(self, index: int) -> Path:
        return self.root / f"events-{index}.jsonl"

    def finished(self, index: int) -> Path:
        return self.root / f"finished-{index}.json"

    def result(self, index: int) -> Path:
        return self.root / f"result-{index}.json"

    def log(self, index: int) -> Path:
        return self.root / f"job-{index}.log"

    @property
    def go(self) -> Path:
        return self.root / "go.json"

    def append_event(self, index: int, event: dict[str, Any]) -> None:
        with self.events(index).open("a", encoding="utf-8") as f:
            f.write(json.dumps(event, sort_keys=True) + "\n")

    def read_events(self, index: int) -> list[dict[str, Any]]:
        return read_json_lines(self.events(index))


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSON-lines file another process may be appending to."""
    if not path.exists():
        return []
    # A line without its newline yet is still being written: leave it for the next read.
    lines = path.read_text(encoding="utf-8").split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]
