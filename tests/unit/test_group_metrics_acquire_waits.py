"""Per-group acquire wait (``group_metrics.AcquireWaits``): the waits of each group's grants
within the window, bounded per group, their nearest-rank quantiles, and nothing kept for a
group without a grant in the window."""

from __future__ import annotations

from timeslice_orchestrator.group_metrics import AcquireWaits


def test_quantiles_are_over_the_grants_within_the_window() -> None:
    waits = AcquireWaits(window=300, per_group=64)
    assert waits.quantile("g", 0.99) is None and waits.count("g") == 0
    for i in range(100):  # 0.00 .. 0.99 s, one grant a second
        waits.add("g", i / 100, now=float(i))
    # Only the newest 64 are kept: 0.36 .. 0.99 s.
    assert waits.count("g") == 64
    assert waits.quantile("g", 0.5) == 0.67  # rank 32 of 64
    assert waits.quantile("g", 0.99) == 0.99  # rank 64 of 64
    waits.add("h", -1.0, now=99.0)  # a clock step back never shows as a negative wait
    assert waits.quantile("h", 0.5) == 0.0
    # 300 s on, the grants before second 50 are out of the window; h's one grant is not.
    waits.expire(now=350.0)
    assert waits.count("g") == 50 and waits.quantile("g", 0.5) == 0.74
    waits.expire(now=400.0)
    assert waits.count("g") == 0 and waits.count("h") == 0
    assert not waits._waits  # groups without a grant in the window are forgotten


def test_a_removed_group_is_forgotten() -> None:
    waits = AcquireWaits(window=300)
    waits.add("g", 2.0, now=0.0)
    waits.forget("g")
    assert waits.quantile("g", 0.5) is None
