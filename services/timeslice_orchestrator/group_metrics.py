"""Per-group series on ``/metrics``: what an operator asks of each group.

Read from the replica's mirror at scrape time (queue depth, hold, switch, the counters the
group's stats record keeps in etcd) and from a :class:`~.holds.HoldTracker` fed by the mirror's
changes (duty cycle, held seconds). Every replica watches every group, so every replica exports
the same group series: aggregate them with ``max by (group)``, never ``sum``.

A deployment may have 100,000 groups; a scrape exports at most ``max_groups`` of them, the
busiest first (held, switching or with waiters, then those held within the duty-cycle
window, by duty cycle), and says how many it left out (``timeslice_group_series_omitted``).
A scrape costs in proportion to those groups, not to all of them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from timeslice_orchestrator.holds import HoldTracker
from timeslice_orchestrator.store.follower import Mirror

DEFAULT_MAX_GROUPS = 1000
_GROUP_PREFIX = "group:"


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

    def start(self) -> None:
        """Track the holds the mirror has now, then every change."""
        names = self._mirror.group_names()
        # Groups there now are watched from now; any later one from when it appears.
        self.tracker.begin(self._clock(), names)
        self.on_change({_GROUP_PREFIX + g for g in names})
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
                    continue
                epoch = self._mirror.hold_epoch(group)
                ended = self.tracker.observe(group, epoch, now)
                if ended is not None:
                    self._hold_seconds.observe(ended)
                if epoch or not self._mirror.idle(group):
                    self._active.add(group)
                else:
                    self._active.discard(group)

    def collect(self) -> Iterator[Metric]:
        now = self._clock()
        mirror, tracker = self._mirror, self.tracker
        tracker.expire(now)
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
        yield from (duty, depth, held, age, switching, last_switch)
        yield from (held_total, switches, grants, rollbacks, faults)
        omitted = GaugeMetricFamily(
            "timeslice_group_series_omitted",
            f"Busy groups left out of this scrape (at most {self._max_groups} are exported)",
        )
        omitted.add_metric([], max(0, len(busy) - len(chosen)))
        yield omitted
