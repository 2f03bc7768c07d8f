"""Per-group series on ``/metrics``: what an operator asks of each group.

Read from the replica's mirror at scrape time (queue depth, hold, switch, the counters the
group's stats record keeps in etcd) and from a :class:`~.holds.HoldTracker` fed by the mirror's
changes (duty cycle, held seconds). Every replica watches every group, so every replica exports
the same group series: aggregate them with ``max by (group)``, never ``sum``.

A deployment may have 100,000 groups; a scrape exports at most ``max_groups`` of them, the
busiest first (held, switching or with waiters, then those held within the duty-cycle
window, by duty cycle), and says how many it left out (``timeslice_group_series_omitted``).
A scrape costs in proportion to those groups, not to all of them.

Acquire wait per group (:class:`AcquireWaits`): every grant's holder record carries how long
its job waited, and every replica's mirror sees every grant, so each replica keeps the waits of
each group's grants within the duty-cycle window (at most ``WAITS_PER_GROUP`` a group, the
newest) and exports their p50 and p99 as gauges: the same figures on every replica, without a
histogram's dozen series per group. The deployment-wide histogram
``timeslice_acquire_wait_seconds`` is observed by the granting replica alone.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from timeslice_orchestrator.holds import HoldTracker
from timeslice_orchestrator.store.follower import Mirror
from timeslice_orchestrator.store.records import CorruptRecord

DEFAULT_MAX_GROUPS = 1000
_GROUP_PREFIX = "group:"
# Grants a group's acquire wait quantiles are over at most (the newest within the window): a
# p99 of 64 grants is their largest but one, which is what a busy group's owner asks about.
WAITS_PER_GROUP = 64
WAIT_QUANTILES = (0.5, 0.99)


class AcquireWaits:
    """How long the jobs of each group's recent grants waited: those granted within the last
    ``window`` seconds, at most ``per_group`` a group (the newest). Memory follows the grants
    made within the window, and a group with none is forgotten."""

    def __init__(self, window: float, per_group: int = WAITS_PER_GROUP) -> None:
        self.window = window
        self.per_group = per_group
        self._waits: dict[str, deque[tuple[float, float]]] = {}  # (granted, waited)

    def add(self, group: str, waited: float, now: float) -> None:
        waits = self._waits.get(group)
        if waits is None:
            waits = self._waits[group] = deque(maxlen=self.per_group)
        waits.append((now, max(0.0, waited)))

    def forget(self, group: str) -> None:
        self._waits.pop(group, None)

    def expire(self, now: float) -> None:
        """Drop the waits of grants older than the window, and the groups left with none."""
        horizon = now - self.window
        for group, waits in list(self._waits.items()):
            while waits and waits[0][0] < horizon:
                waits.popleft()
            if not waits:
                del self._waits[group]

    def count(self, group: str) -> int:
        return len(self._waits.get(group, ()))

    def quantile(self, group: str, q: float) -> float | None:
        """The nearest-rank ``q`` quantile of the group's waits kept (None: none kept)."""
        waits = sorted(w for _, w in self._waits.get(group, ()))
        if not waits:
            return None
        return waits[max(0, math.ceil(q * len(waits)) - 1)]


class GroupMetrics(Collector):
    """The collector; :meth:`on_change` is the mirror listener that feeds the hold tracker."""

    def __init__(
        self,
        mirror: Mirror,
        hold_seconds: Histogram,
        tracker: HoldTracker | None = None,
        max_groups: int = DEFAULT_MAX_GROUPS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._mirror = mirror
        self._hold_seconds = hold_seconds
        self.tracker = tracker or HoldTracker(started=clock())
        self._max_groups = max_groups
        self._clock = clock
        # Groups held, switching or with waiters, kept up to date on every change: a scrape
        # looks at these and at the recently held ones, not at every group of the mirror.
        self._active: set[str] = set()
        self.waits = AcquireWaits(self.tracker.window)
        self._epochs: dict[str, int] = {}  # the hold epoch of each group held (a new one: a grant)

    def start(self) -> None:
        """Track the holds the mirror has now, then every change."""
        names = self._mirror.group_names()
        # Groups there now are watched from now; any later one from when it appears.
        self.tracker.begin(self._clock(), names)
        # Holds granted before this replica watched are not grants it saw.
        self._epochs = {g: e for g in names if (e := self._mirror.hold_epoch(g))}
        # A free idle group has nothing to track before its next change: most groups of a
        # large deployment are (tests/integration/test_scale.py starts on 100,000).
        busy = [g for g in names if not self._mirror.quiet(g)]
        self.on_change({_GROUP_PREFIX + g for g in busy})
        self._mirror.add_listener(self.on_change)

    def stop(self) -> None:
        self._mirror.remove_listener(self.on_change)

    def on_change(self, topics: set[str]) -> None:
        now = self._clock()
        for topic in topics:
            if topic.startswith(_GROUP_PREFIX):
                group = topic[len(_GROUP_PREFIX) :]
                if not self._mirror.has_group(group):
                    self.tracker.forget(group)  # removed: a group of that name is a new one
                    self._active.discard(group)
                    self.waits.forget(group)
                    self._epochs.pop(group, None)
                    continue
                epoch = self._mirror.hold_epoch(group)
                self._granted(group, epoch, now)
                ended = self.tracker.observe(group, epoch, now)
                if ended is not None:
                    self._hold_seconds.observe(ended)
                if epoch or not self._mirror.idle(group):
                    self._active.add(group)
                else:
                    self._active.discard(group)

    def _granted(self, group: str, epoch: int, now: float) -> None:
        """Note the wait of the grant that made hold ``epoch``, if it is a new hold."""
        if not epoch:
            self._epochs.pop(group, None)
            return
        if self._epochs.get(group) == epoch:
            return
        self._epochs[group] = epoch
        try:
            hold = self._mirror.holder(group)
        except CorruptRecord:
            return  # the switch driver reports an undecodable hold; no wait to note here
        if hold is not None:
            self.waits.add(group, hold.record.waited_seconds, now)

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        mirror, tracker = self._mirror, self.tracker
        tracker.expire(now)
        self.waits.expire(now)
        for gone in [g for g in tracker.groups() if not mirror.has_group(g)]:
            tracker.forget(gone)
        self._active = {g for g in self._active if mirror.has_group(g)}
        busy = [(0, -tracker.duty_cycle(g, now), g) for g in self._active]
        busy += [
            (1, -tracker.duty_cycle(g, now), g) for g in tracker.groups() if g not in self._active
        ]
        busy.sort()
        chosen = [g for _, _, g in busy[: self._max_groups]]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["group"])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=["group"])

        duty = gauge(
            "timeslice_group_duty_cycle_ratio",
            f"Fraction of the last {tracker.window:g} s (or of the time this replica has "
            "watched the group, if shorter) in which the group was held",
        )
        depth = gauge("timeslice_group_queue_depth", "Jobs waiting for the group")
        held = gauge("timeslice_group_held", "1 while a job holds the group")
        age = gauge("timeslice_group_hold_age_seconds", "How long the hold in progress has lasted")
        switching = gauge("timeslice_group_switching", "1 while a switch of the group runs")
        last_switch = gauge(
            "timeslice_group_last_switch_seconds", "Wall time of the group's last switch"
        )
        held_total = counter(
            "timeslice_group_held_seconds",
            "Seconds the group was held while this replica watched it (restarts from 0 when "
            "the group was idle for the whole window; rate() of it is the duty cycle)",
        )
        switches = counter("timeslice_group_switches", "Switches committed (cluster-wide)")
        grants = counter("timeslice_group_grants", "Grants made (cluster-wide)")
        rollbacks = counter(
            "timeslice_group_rollbacks", "Switches that failed and were rolled back (cluster-wide)"
        )
        faults = counter(
            "timeslice_group_faults", "Waiters given up on after their switch failed for good"
        )
        wait = GaugeMetricFamily(
            "timeslice_group_acquire_wait_seconds",
            f"Acquire wait of the group's grants within the last {self.waits.window:g} s "
            f"(at most the newest {self.waits.per_group}), by quantile (nearest rank)",
            labels=["group", "quantile"],
        )
        waits = gauge(
            "timeslice_group_acquire_waits",
            "Grants the group's acquire wait quantiles are over",
        )
        for group in chosen:
            view = mirror.group(group)
            labels = [group]
            duty.add_metric(labels, tracker.duty_cycle(group, now))
            depth.add_metric(labels, len(view.queue))
            held.add_metric(labels, 1 if view.holder is not None else 0)
            age.add_metric(labels, tracker.hold_age(group, now))
            switching.add_metric(labels, 1 if view.switch is not None else 0)
            last_switch.add_metric(labels, view.stats.last_switch_seconds)
            held_total.add_metric(labels, tracker.held_seconds(group, now))
            switches.add_metric(labels, view.stats.switches)
            grants.add_metric(labels, view.stats.grants)
            rollbacks.add_metric(labels, view.stats.rollbacks)
            faults.add_metric(labels, view.stats.faults)
            if n := self.waits.count(group):
                waits.add_metric(labels, n)
                for q in WAIT_QUANTILES:
                    wait.add_metric([group, f"{q:g}"], self.waits.quantile(group, q) or 0.0)
        yield from (duty, depth, held, age, switching, last_switch, wait, waits)
        yield from (held_total, switches, grants, rollbacks, faults)
        omitted = GaugeMetricFamily(
            "timeslice_group_series_omitted",
            f"Busy groups left out of this scrape (at most {self._max_groups} are exported)",
        )
        omitted.add_metric([], max(0, len(busy) - len(chosen)))
        yield omitted
