"""Pure functions over recorded job phases: duty cycle, switches, step times, text timelines.

The demo's jobs (and later the benchmarks) record every phase of every step as a
:class:`PhaseRecord`, one JSON object per line. Everything here is a pure function of those
records so it is unit-tested on known inputs and reused as is.

Times are unix seconds (``time.time()``) so records from several processes line up.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import fmean

__all__ = [
    "DemoPhase",
    "Interval",
    "PhaseRecord",
    "SwitchEvent",
    "accelerator_intervals",
    "covered_seconds",
    "duty_cycle",
    "hold_spans",
    "mean_or_zero",
    "read_records",
    "render_timeline",
    "span_of",
    "step_durations",
    "switch_events",
    "union",
]


@dataclass(frozen=True, order=True)
class Interval:
    """A closed-open time interval ``[start, end)`` in seconds."""

    start: float
    end: float

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"interval ends ({self.end}) before it starts ({self.start})")

    @property
    def duration(self) -> float:
        return self.end - self.start

    def overlap(self, other: Interval) -> float:
        """Seconds this interval shares with ``other``."""
        return max(0.0, min(self.end, other.end) - max(self.start, other.start))


class DemoPhase(enum.Enum):
    """The phases of one synchronous-RL step of a demo run, in the order recorded.

    ``bench.profiles.StepPhase`` is the benchmarks' modelled counterpart (with async RL's phases
    too, and ``queue`` where this says ``wait``). Not a switch's phases: those are the
    orchestrator's ``SwitchPhase``."""

    REWARD = "reward"  # off the accelerators: environments, reward models on CPU
    WAIT = "wait"  # from calling acquire until the grant
    ROLLOUT = "rollout"
    TRAIN = "train"
    SYNC = "sync"  # weight sync from trainer to the inference engines

    @property
    def on_accelerator(self) -> bool:
        return self in (DemoPhase.ROLLOUT, DemoPhase.TRAIN, DemoPhase.SYNC)


@dataclass(frozen=True)
class PhaseRecord:
    """One phase of one step of one job.

    The grant fields (``epoch``, ``restored``, ``switch_seconds``, ``previous_job``) describe the
    grant under which an accelerator phase ran; they are zero/empty for the other phases.
    """

    job: str
    phase: DemoPhase
    group: str
    step: int
    start: float
    end: float
    epoch: int = 0
    restored: bool = False
    switch_seconds: float = 0.0
    previous_job: str = ""

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(
                f"{self.job} {self.phase.value} step {self.step} ends before it starts"
            )

    @property
    def interval(self) -> Interval:
        return Interval(self.start, self.end)

    def to_json(self) -> str:
        data = asdict(self)
        data["phase"] = self.phase.value
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> PhaseRecord:
        """Parse one JSONL line; raises ValueError naming what is wrong."""
        try:
            data = json.loads(line)
            return cls(
                job=str(data["job"]),
                phase=DemoPhase(data["phase"]),
                group=str(data["group"]),
                step=int(data["step"]),
                start=float(data["start"]),
                end=float(data["end"]),
                epoch=int(data.get("epoch", 0)),
                restored=bool(data.get("restored", False)),
                switch_seconds=float(data.get("switch_seconds", 0.0)),
                previous_job=str(data.get("previous_job", "")),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a phase record: {line.strip()[:200]!r} ({exc!r})") from exc


@dataclass(frozen=True)
class SwitchEvent:
    """A grant that needed a context switch: ``from_job``'s state out, ``to_job``'s in."""

    group: str
    at: float  # the grant time, when the switch finished
    from_job: str  # empty when nothing was resident before
    to_job: str
    seconds: float

    @property
    def interval(self) -> Interval:
        return Interval(self.at - self.seconds, self.at)


def read_records(path: Path) -> list[PhaseRecord]:
    """All records of a JSONL file, in file order (blank lines skipped)."""
    with path.open(encoding="utf-8") as f:
        return [PhaseRecord.from_json(line) for line in f if line.strip()]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The sorted, disjoint intervals covering exactly the same time (empty ones dropped)."""
    merged: list[Interval] = []
    for item in sorted(i for i in intervals if i.duration > 0):
        if merged and item.start <= merged[-1].end:
            if item.end > merged[-1].end:
                merged[-1] = Interval(merged[-1].start, item.end)
        else:
            merged.append(item)
    return merged


def covered_seconds(intervals: Iterable[Interval], window: Interval) -> float:
    """Seconds of ``window`` covered by at least one of ``intervals``."""
    return sum(i.overlap(window) for i in union(intervals))


def duty_cycle(intervals: Iterable[Interval], window: Interval) -> float:
    """Fraction of ``window`` during which at least one interval is active (0.0 to 1.0)."""
    if window.duration <= 0:
        raise ValueError("the window must have a positive duration")
    return covered_seconds(intervals, window) / window.duration


def span_of(records: Iterable[PhaseRecord]) -> Interval:
    """From the first record's start to the last record's end."""
    items = list(records)
    if not items:
        raise ValueError("no records")
    return Interval(min(r.start for r in items), max(r.end for r in items))


def accelerator_intervals(records: Iterable[PhaseRecord], group: str) -> list[Interval]:
    """When some job was inside an accelerator phase on ``group``."""
    return [r.interval for r in records if r.group == group and r.phase.on_accelerator]


def hold_spans(records: Iterable[PhaseRecord], group: str) -> list[tuple[str, Interval]]:
    """Per (job, step) on ``group``: the job and the span of its accelerator phases, by start."""
    spans: dict[tuple[str, int], Interval] = {}
    for r in records:
        if r.group != group or not r.phase.on_accelerator:
            continue
        key = (r.job, r.step)
        seen = spans.get(key)
        spans[key] = (
            r.interval if seen is None else Interval(min(seen.start, r.start), max(seen.end, r.end))
        )
    return sorted(((job, span) for (job, _), span in spans.items()), key=lambda x: x[1])


def switch_events(records: Iterable[PhaseRecord]) -> list[SwitchEvent]:
    """Grants that moved device state, one per (job, step, group), by time.

    A grant counts as a switch when the job's state was restored or another job's state was
    on the devices before it (``previous_job``). Its time is the start of the first accelerator
    phase under that grant.
    """
    first: dict[tuple[str, int, str], PhaseRecord] = {}
    for r in records:
        if not r.phase.on_accelerator:
            continue
        key = (r.job, r.step, r.group)
        if key not in first or r.start < first[key].start:
            first[key] = r
    events = [
        SwitchEvent(
            group=r.group,
            at=r.start,
            from_job=r.previous_job,
            to_job=r.job,
            seconds=r.switch_seconds,
        )
        for r in first.values()
        if r.restored or (r.previous_job != "" and r.previous_job != r.job)
    ]
    return sorted(events, key=lambda e: (e.at, e.group, e.to_job))


def step_durations(records: Iterable[PhaseRecord], job: str) -> list[float]:
    """Each step's wall time for ``job`` (first phase start to last phase end), by step."""
    spans: dict[int, Interval] = {}
    for r in records:
        if r.job != job:
            continue
        seen = spans.get(r.step)
        spans[r.step] = (
            r.interval if seen is None else Interval(min(seen.start, r.start), max(seen.end, r.end))
        )
    return [spans[step].duration for step in sorted(spans)]


def mean_or_zero(values: Sequence[float]) -> float:
    """The mean, or 0.0 for no values (a report line must not crash on an empty run)."""
    return fmean(values) if values else 0.0


def render_timeline(
    spans: Sequence[tuple[str, Interval]],
    window: Interval,
    *,
    marks: Sequence[Interval] = (),
    width: int = 100,
    idle: str = ".",
    mark: str = "S",
) -> str:
    """One character per time bucket of ``window``.

    A bucket shows ``mark`` when a mark (a switch) overlaps it (a zero-length mark counts in
    the bucket containing it), else the label covering most of the bucket (ties: the smaller
    label), else ``idle``. Labels, ``idle`` and ``mark`` are single characters.
    """
    if width < 1:
        raise ValueError("width must be at least 1")
    if window.duration <= 0:
        raise ValueError("the window must have a positive duration")
    for label in [idle, mark, *(label for label, _ in spans)]:
        if len(label) != 1:
            raise ValueError(f"timeline labels must be single characters, got {label!r}")
    step = window.duration / width
    out: list[str] = []
    for index in range(width):
        start = window.start + index * step
        end = window.end if index == width - 1 else window.start + (index + 1) * step
        bucket = Interval(start, end)
        if any(_touches(m, bucket, last=index == width - 1) for m in marks):
            out.append(mark)
            continue
        cover: dict[str, float] = {}
        for label, span in spans:
            seconds = span.overlap(bucket)
            if seconds > 0:
                cover[label] = cover.get(label, 0.0) + seconds
        if cover:
            out.append(min(cover, key=lambda lbl: (-cover[lbl], lbl)))
        else:
            out.append(idle)
    return "".join(out)


def _touches(m: Interval, bucket: Interval, *, last: bool) -> bool:
    if m.duration > 0:
        return m.overlap(bucket) > 0
    return bucket.start <= m.start < bucket.end or (last and m.start == bucket.end)
