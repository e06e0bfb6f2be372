"""Each worker's recent data-path failures from the cumulative counts the monitor reads."""

from __future__ import annotations

from controller.recent_failures import RecentFailures


def test_failures_count_while_in_the_window_and_not_after() -> None:
    recent = RecentFailures(window_s=10.0)
    recent.read({"w1": 1}, now=0.0)
    recent.read({"w1": 3}, now=4.0)
    assert recent.recent("w1", now=9.0) == 3
    assert recent.recent("w1", now=10.0) == 2  # the first has left the window
    assert recent.recent("w1", now=14.0) == 0
    assert recent.recent("w2", now=14.0) == 0


def test_failures_acted_on_count_no_more_and_later_ones_do() -> None:
    recent = RecentFailures(window_s=10.0)
    recent.read({"w1": 3}, now=0.0)
    recent.acted_on("w1")
    assert recent.recent("w1", now=1.0) == 0
    recent.read({"w1": 4}, now=2.0)
    assert recent.recent("w1", now=3.0) == 1


def test_a_count_that_fell_started_over_and_a_missing_one_is_forgotten() -> None:
    recent = RecentFailures(window_s=10.0)
    recent.read({"w1": 5, "w2": 2}, now=0.0)
    recent.acted_on("w1")
    recent.read({"w1": 2}, now=1.0)  # its field expired and came back with 2 new failures; w2's expired
    assert recent.recent("w1", now=1.0) == 2
    assert list(recent.workers()) == ["w1"]
    recent.read({"w2": 1}, now=2.0)
    assert recent.recent("w2", now=2.0) == 1
