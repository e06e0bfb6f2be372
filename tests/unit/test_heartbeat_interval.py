"""The heartbeat interval the registry hands out: the floor for a small fleet, stretched past the budget, with
jitter above it and a TTL that covers it."""

from __future__ import annotations

import pytest

from controller.heartbeat_interval import JITTER, HeartbeatPace, fleet_interval_s, next_beat

DEFAULT = HeartbeatPace(floor_s=0.5, grace_s=1.0, calls_per_s_per_process=1000, api_processes=2)


@pytest.mark.parametrize(("workers", "interval_s"), [(0, 0.5), (10, 0.5), (1000, 0.5), (2000, 1.0),
                                                      (10_000, 5.0), (100_000, 50.0)])
def test_the_interval_is_the_floor_until_the_fleet_passes_the_budget(workers: int, interval_s: float) -> None:
    assert fleet_interval_s(DEFAULT, workers) == pytest.approx(interval_s)


def test_the_interval_grows_with_the_fleet_and_shrinks_when_it_shrinks() -> None:
    sizes = [100, 1000, 3000, 10_000, 30_000, 10_000, 3000, 100]
    intervals = [fleet_interval_s(DEFAULT, n) for n in sizes]
    print(dict(zip(sizes, intervals, strict=True)))
    assert intervals[:5] == sorted(intervals[:5]) and intervals[4:] == sorted(intervals[4:], reverse=True)
    assert intervals[0] == intervals[-1] == DEFAULT.floor_s


@pytest.mark.parametrize("workers", [10, 1000, 10_000, 100_000])
@pytest.mark.parametrize("draw", [0.0, 0.3, 0.999])
def test_the_fleet_stays_under_the_budget_whatever_the_jitter_draws(workers: int, draw: float) -> None:
    beat = next_beat(DEFAULT, workers, draw)
    calls_per_s = workers / beat.interval_s
    assert beat.interval_s >= DEFAULT.floor_s
    assert calls_per_s <= DEFAULT.calls_per_s_per_process * DEFAULT.api_processes + 1e-9


def test_jitter_spreads_a_fleet_over_a_quarter_of_its_interval() -> None:
    low, high = next_beat(DEFAULT, 10_000, 0.0), next_beat(DEFAULT, 10_000, 0.999)
    assert low.interval_s == pytest.approx(5.0)
    assert high.interval_s == pytest.approx(5.0 * (1 + JITTER * 0.999))


@pytest.mark.parametrize("workers", [10, 1000, 2000, 10_000])
def test_the_ttl_covers_the_longest_interval_handed_and_a_grace(workers: int) -> None:
    longest = next_beat(DEFAULT, workers, 0.999_999)
    interval_s = fleet_interval_s(DEFAULT, workers)
    assert longest.ttl_s >= longest.interval_s + DEFAULT.grace_s
    assert longest.ttl_s >= longest.interval_s + interval_s  # a stretched fleet survives one lost heartbeat


def test_the_default_detects_a_silent_worker_in_time() -> None:
    """The issue's targets by TTL alone: 5 s at 1,000 workers and 15 s at 10,000 on a 2-core registry."""
    assert next_beat(DEFAULT, 1000, 0.0).ttl_s <= 5
    assert next_beat(DEFAULT, 10_000, 0.0).ttl_s <= 15


def test_a_node_batch_counts_as_one_call_for_its_workers() -> None:
    per_worker, batched = fleet_interval_s(DEFAULT, 10_000), fleet_interval_s(DEFAULT, 10_000, workers_per_call=8)
    assert batched == pytest.approx(per_worker / 8)


def test_more_api_processes_afford_shorter_intervals() -> None:
    wider = HeartbeatPace(floor_s=0.5, grace_s=1.0, calls_per_s_per_process=1000, api_processes=8)
    assert fleet_interval_s(wider, 10_000) == pytest.approx(fleet_interval_s(DEFAULT, 10_000) / 4)
