"""The demo's and benchmarks' pure functions: known inputs, exact outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from timeslice_tools.dev import demo
from timeslice_tools.dev.timeline import (
    DemoPhase,
    Interval,
    PhaseRecord,
    SwitchEvent,
    accelerator_intervals,
    covered_seconds,
    duty_cycle,
    hold_spans,
    mean_or_zero,
    read_records,
    render_timeline,
    span_of,
    step_durations,
    switch_events,
    union,
)


def rec(
    job: str,
    phase: DemoPhase,
    step: int,
    start: float,
    end: float,
    *,
    group: str = "g",
    restored: bool = False,
    previous: str = "",
    switch: float = 0.0,
    epoch: int = 0,
) -> PhaseRecord:
    return PhaseRecord(
        job=job,
        phase=phase,
        group=group,
        step=step,
        start=start,
        end=end,
        epoch=epoch,
        restored=restored,
        switch_seconds=switch,
        previous_job=previous,
    )


def test_interval_rejects_negative_length() -> None:
    with pytest.raises(ValueError, match="before it starts"):
        Interval(2.0, 1.0)


def test_union_merges_overlapping_and_touching_and_drops_empty() -> None:
    got = union([Interval(5, 6), Interval(0, 1), Interval(0.5, 2), Interval(2, 3), Interval(4, 4)])
    assert got == [Interval(0, 3), Interval(5, 6)]


def test_union_keeps_contained_intervals_inside() -> None:
    assert union([Interval(0, 10), Interval(2, 3)]) == [Interval(0, 10)]


def test_covered_seconds_clips_to_window() -> None:
    intervals = [Interval(-1, 1), Interval(0.5, 2), Interval(3, 5), Interval(9, 12)]
    assert covered_seconds(intervals, Interval(0, 10)) == 2 + 2 + 1


def test_duty_cycle_counts_overlap_once() -> None:
    # Two jobs overlapping on [1, 2) still make the accelerator busy only 3 of 8 seconds.
    assert duty_cycle([Interval(0, 2), Interval(1, 3)], Interval(0, 8)) == 0.375


def test_duty_cycle_needs_a_window() -> None:
    with pytest.raises(ValueError, match="positive duration"):
        duty_cycle([Interval(0, 1)], Interval(1, 1))


def test_render_timeline_majority_idle_and_ties() -> None:
    spans = [("A", Interval(0, 3)), ("B", Interval(3, 5)), ("B", Interval(7.5, 8))]
    # Buckets of 1 s; the last bucket is half B, half idle: any coverage beats idle.
    assert render_timeline(spans, Interval(0, 8), width=8) == "AAABB..B"
    tie = [("B", Interval(0, 0.5)), ("A", Interval(0.5, 1))]
    assert render_timeline(tie, Interval(0, 1), width=1) == "A"


def test_render_timeline_marks_switches_over_holders() -> None:
    spans = [("A", Interval(0, 4)), ("B", Interval(4, 8))]
    marks = [Interval(3.75, 4.25), Interval(6, 6)]  # a real switch and a zero-length one
    assert render_timeline(spans, Interval(0, 8), marks=marks, width=8) == "AAASSBSB"


def test_render_timeline_zero_length_mark_at_window_end_lands_in_last_bucket() -> None:
    assert render_timeline([], Interval(0, 4), marks=[Interval(4, 4)], width=4) == "...S"


def test_render_timeline_rejects_multi_character_labels() -> None:
    with pytest.raises(ValueError, match="single characters"):
        render_timeline([("AB", Interval(0, 1))], Interval(0, 1), width=4)
    with pytest.raises(ValueError, match="width"):
        render_timeline([], Interval(0, 1), width=0)


def shared_run() -> list[PhaseRecord]:
    """Two jobs time-slicing group g: A steps 0-1, B steps 0-1, with switches A->B, B->A."""
    return [
        rec("a", DemoPhase.REWARD, 0, 0.0, 1.0),
        rec("a", DemoPhase.WAIT, 0, 1.0, 1.0, epoch=10),
        rec("a", DemoPhase.ROLLOUT, 0, 1.0, 1.5, epoch=10),
        rec("a", DemoPhase.TRAIN, 0, 1.5, 2.0, epoch=10),
        rec("b", DemoPhase.REWARD, 0, 0.0, 1.0),
        rec("b", DemoPhase.WAIT, 0, 1.0, 2.25, epoch=11, restored=True, previous="a", switch=0.25),
        rec(
            "b", DemoPhase.ROLLOUT, 0, 2.25, 3.0, epoch=11, restored=True, previous="a", switch=0.25
        ),
        rec("b", DemoPhase.SYNC, 0, 3.0, 3.25, epoch=11, restored=True, previous="a", switch=0.25),
        rec("a", DemoPhase.REWARD, 1, 2.0, 3.0),
        rec("a", DemoPhase.WAIT, 1, 3.0, 3.5, epoch=12, restored=True, previous="b", switch=0.25),
        rec(
            "a", DemoPhase.ROLLOUT, 1, 3.5, 4.0, epoch=12, restored=True, previous="b", switch=0.25
        ),
    ]


def test_accelerator_intervals_and_duty_cycle_of_a_recorded_run() -> None:
    records = shared_run()
    assert span_of(records) == Interval(0.0, 4.0)
    busy = accelerator_intervals(records, "g")
    assert union(busy) == [Interval(1.0, 2.0), Interval(2.25, 3.25), Interval(3.5, 4.0)]
    assert duty_cycle(busy, span_of(records)) == 0.625
    assert accelerator_intervals(records, "other") == []


def test_hold_spans_one_per_job_step_in_time_order() -> None:
    assert hold_spans(shared_run(), "g") == [
        ("a", Interval(1.0, 2.0)),
        ("b", Interval(2.25, 3.25)),
        ("a", Interval(3.5, 4.0)),
    ]


def test_switch_events_one_per_grant() -> None:
    events = switch_events(shared_run())
    assert events == [
        SwitchEvent(group="g", at=2.25, from_job="a", to_job="b", seconds=0.25),
        SwitchEvent(group="g", at=3.5, from_job="b", to_job="a", seconds=0.25),
    ]
    assert events[0].interval == Interval(2.0, 2.25)


def test_first_restore_from_nothing_counts_without_a_previous_job() -> None:
    records = [rec("a", DemoPhase.ROLLOUT, 0, 1.0, 2.0, restored=True, switch=0.5)]
    assert switch_events(records) == [SwitchEvent("g", 1.0, "", "a", 0.5)]


def test_step_durations_span_all_phases_of_each_step() -> None:
    records = shared_run()
    assert step_durations(records, "a") == [2.0, 2.0]
    assert step_durations(records, "b") == [3.25]
    assert step_durations(records, "nobody") == []
    assert mean_or_zero([]) == 0.0
    assert mean_or_zero([1.0, 2.0]) == 1.5


def test_timeline_of_the_recorded_run() -> None:
    records = shared_run()
    labels = {"a": "A", "b": "B"}
    spans = [(labels[j], s) for j, s in hold_spans(records, "g")]
    marks = [e.interval for e in switch_events(records)]
    assert render_timeline(spans, span_of(records), marks=marks, width=16) == "....AAAASBBBBSAA"


def test_records_round_trip_through_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    records = shared_run()
    path.write_text("".join(r.to_json() + "\n" for r in records) + "\n")
    assert read_records(path) == records


def test_bad_record_line_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not a phase record"):
        PhaseRecord.from_json('{"job": "a"}')
    with pytest.raises(ValueError, match="not a phase record"):
        PhaseRecord.from_json("not json")
    with pytest.raises(ValueError):
        PhaseRecord.from_json(rec("a", DemoPhase.TRAIN, 0, 0, 1).to_json().replace("train", "nap"))


def test_demo_profile_is_forty_percent_accelerator() -> None:
    profile = demo.JobProfile()
    assert profile.accelerator_fraction == pytest.approx(0.4)
    assert profile.step_seconds == pytest.approx(1.0)


def test_demo_report_from_synthetic_records() -> None:
    """The report renders from records alone: timelines, switches, duty cycles, slowdown."""
    a, b = demo.JOBS[0].job_id, demo.JOBS[1].job_id
    ga, gb = demo.DEDICATED.groups["A"], demo.DEDICATED.groups["B"]
    gs = demo.SHARED.groups["A"]
    dedicated = []
    shared = []
    for step in range(2):
        t = float(step)
        dedicated += [
            rec(a, DemoPhase.REWARD, step, t, t + 0.5, group=ga),
            rec(a, DemoPhase.TRAIN, step, t + 0.5, t + 1.0, group=ga),
            rec(b, DemoPhase.REWARD, step, t, t + 0.75, group=gb),
            rec(b, DemoPhase.TRAIN, step, t + 0.75, t + 1.0, group=gb),
        ]
        shared += [
            rec(a, DemoPhase.REWARD, step, 2 * t, 2 * t + 0.5, group=gs),
            rec(
                a,
                DemoPhase.TRAIN,
                step,
                2 * t + 0.5,
                2 * t + 1.0,
                group=gs,
                previous=b,
                restored=step > 0,
                switch=0.125,
            ),
            rec(b, DemoPhase.REWARD, step, 2 * t, 2 * t + 1.0, group=gs),
            rec(
                b,
                DemoPhase.TRAIN,
                step,
                2 * t + 1.0,
                2 * t + 2.0,
                group=gs,
                previous=a,
                restored=True,
                switch=0.125,
            ),
        ]
    text = demo.report(demo.DemoResult(dedicated, shared, demo.JobProfile()))
    assert "(sim backend: emulated data movement)" in text
    assert f"dedicated  {ga:20}  50.0%" in text
    assert f"dedicated  {gb:20}  25.0%" in text
    assert f"shared     {gs:20}  75.0%" in text
    assert "B -> A  switch  125.0 ms" in text
    assert "A -> B  switch  125.0 ms" in text
    assert "4 switches, mean 125.0 ms" in text
    assert f"  {a:12}     1.000s     1.000s     1.00x" in text
    assert f"  {b:12}     1.000s     2.000s     2.00x" in text
    rows = [line for line in text.splitlines() if line.strip().startswith(gs)]
    assert len(rows) == 1 and rows[0].count("|") == 2
    assert len(rows[0].split("|")[1]) == demo.TIMELINE_WIDTH
