"""Capacity-planned autoscaling on hand-made histories: a rise met before a queue forms, a dip shorter than
the start-up time kept, a second rise met while a worker starts, a sleeping worker woken for a burst, and
the start-up time learned from the pool's own launches."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from controller.autoscale import Action, PoolSample, decide
from controller.autoscale_plan import DemandPoint, trend
from controller.autoscaler import StartupTimes
from poolgate.kernel.config import AutoscaleSettings, PoolScaling, WorkerTemplate

PLANNED = AutoscaleSettings(worker_capacity=1.0, startup_s=30.0, wake_s=2.0, demand_window_s=5.0,
                            trend_window_s=30.0, up_waiting_per_worker=2.0, up_sustain_s=3.0)
REACTIVE = PLANNED.model_copy(update={"worker_capacity": 0.0})
BOUNDS = PoolScaling(min_workers=1, max_workers=8)
SLEEPS = PoolScaling(min_workers=1, max_workers=8, sleep_level=1,
                     template=WorkerTemplate(extra_args=("--enable-sleep-mode",)))


def history(seconds: int, demand: Callable[[int], float], workers: int, *, ready: int | None = None,
            sleeping: int = 0) -> list[PoolSample]:
    """One sample a second; nothing waits (the demand is carried: requests in flight only)."""
    return [PoolSample(float(t), workers, workers if ready is None else ready, waiting=0,
                       running=round(demand(t)), kv_usage=0.2, demand=demand(t), sleeping=sleeping)
            for t in range(seconds + 1)]


def test_a_rise_is_met_before_any_request_waits() -> None:
    rising = history(30, lambda t: 1.0 + t / 30, workers=2)  # 1 → 2 in flight over 30 s, 2 workers of 1
    assert all(s.waiting == 0 for s in rising)
    decision = decide(rising, BOUNDS, PLANNED, now=30.0, last_change_at=None)
    # level ≈ 1.93, trend 1/30 per s, 30 s ahead ≈ 2.9: a third worker now, serving when the demand needs it.
    assert decision.action is Action.UP and decision.target == 3 and "trend +0.033/s" in decision.reason
    # The pressure rules alone see no queue yet: no step up (here they even release a worker on the rise).
    assert decide(rising, BOUNDS, REACTIVE, now=30.0, last_change_at=None).action is not Action.UP


def test_the_start_up_time_sets_how_far_ahead_the_pool_plans() -> None:
    rising = history(30, lambda t: 1.0 + t / 30, workers=2)
    quick = decide(rising, BOUNDS, PLANNED, now=30.0, last_change_at=None, startup_s=2.0)
    assert quick.action is Action.HOLD  # a 2-s start can wait until the demand is there


def test_a_dip_shorter_than_the_start_up_time_keeps_the_workers() -> None:
    dip = history(60, lambda t: 2.8 if t < 45 else 0.4, workers=3)  # 15 s low, start-up 30 s
    decision = decide(dip, BOUNDS, PLANNED, now=60.0, last_change_at=None)
    assert decision.action is Action.HOLD and "peaked at 2.80 over the last 30 s" in decision.reason


def test_a_dip_longer_than_the_start_up_time_releases_them_at_once() -> None:
    trough = history(80, lambda t: 2.8 if t < 40 else 0.4, workers=3)  # 40 s low
    decision = decide(trough, BOUNDS, PLANNED, now=80.0, last_change_at=None)
    assert decision.action is Action.DOWN and decision.target == 1


def test_a_load_between_two_sizes_does_not_release_a_worker() -> None:
    between = history(80, lambda t: 1.9, workers=3)  # 2 workers carry it, but at 95 % of capacity
    assert decide(between, BOUNDS, PLANNED, now=80.0, last_change_at=None).action is Action.HOLD


def test_a_second_rise_while_a_worker_starts_gets_another_worker() -> None:
    # 3 workers, one still starting (its start counted); the demand keeps climbing past what 3 carry.
    climbing = history(30, lambda t: 2.0 + t / 15, workers=3, ready=2)
    decision = decide(climbing, BOUNDS, PLANNED, now=30.0, last_change_at=25.0)
    assert decision.action is Action.UP and decision.target > 3 and "counting 1 starting" in decision.reason
    covered = history(30, lambda t: 2.5, workers=3, ready=2)
    assert decide(covered, BOUNDS, PLANNED, now=30.0, last_change_at=25.0).action is Action.HOLD


def test_a_sleeping_worker_is_woken_for_a_burst() -> None:
    burst = history(20, lambda t: 0.5 if t < 15 else 1.8, workers=1, sleeping=2)
    decision = decide(burst, SLEEPS, PLANNED, now=20.0, last_change_at=None)
    assert decision.action is Action.UP and decision.target == 2 and "wakes 1 sleeping" in decision.reason
    assert "in 2 s" in decision.reason  # looking ahead by a wake-up, not by a start


def test_a_pool_that_sleeps_its_surplus_lets_it_go_after_a_wake_up_time() -> None:
    dip = history(60, lambda t: 2.8 if t < 45 else 0.4, workers=3)  # the dip that a stopping pool kept
    decision = decide(dip, SLEEPS, PLANNED, now=60.0, last_change_at=None)
    assert decision.action is Action.DOWN and decision.target == 1 and "the rest sleep" in decision.reason


def test_a_pool_that_sleeps_keeps_a_worker_still_starting_for_a_start_up_time() -> None:
    # A worker launched 10 s ago (30-s start-up) for a rise that faded: it cannot sleep, so it is not
    # released on a wake-up's hold (stopping it would waste its launch and pay another on the next rise).
    faded = history(60, lambda t: 1.6 if t < 50 else 0.6, workers=2, ready=1)
    decision = decide(faded, SLEEPS, PLANNED, now=60.0, last_change_at=50.0)
    assert decision.action is Action.HOLD and "start-up time" in decision.reason


def test_bounds_still_win_over_the_plan() -> None:
    flood = history(30, lambda t: 50.0, workers=8)
    assert decide(flood, BOUNDS, PLANNED, now=30.0, last_change_at=None).action is Action.HOLD
    idle = history(80, lambda t: 0.0, workers=1)
    assert decide(idle, BOUNDS, PLANNED, now=80.0, last_change_at=None).action is Action.HOLD


def test_the_trend_is_a_rise_that_held_over_the_window_not_one_step() -> None:
    ramp = [DemandPoint(float(t), 3.0 + 0.5 * t) for t in range(11)]
    assert abs(trend(ramp, now=10.0, window_s=10.0) - 0.5) < 1e-9
    step = [DemandPoint(float(t), 3.0 if t < 8 else 6.0) for t in range(11)]
    assert trend(step, now=10.0, window_s=10.0) == 0.0


def test_the_start_up_time_is_learned_from_the_pools_launches() -> None:
    times = StartupTimes()
    assert times.estimate(30.0) == 30.0
    times.observe({"chat-2"}, set(), now=100.0)
    times.observe({"chat-2", "chat-3"}, set(), now=104.0)
    times.observe({"chat-3"}, {"chat-2"}, now=109.0)
    times.observe(set(), {"chat-2", "chat-3"}, now=115.0)
    assert times.estimate(30.0) == (9.0 + 11.0) / 2
    times.observe({"chat-4"}, {"chat-2", "chat-3"}, now=120.0)
    times.observe(set(), {"chat-2", "chat-3"}, now=121.0)  # chat-4 stopped before it served: no figure
    assert times.estimate(30.0) == 10.0
    times.observe({"chat-2"}, {"chat-3"}, now=130.0)  # chat-2 failed for a while: not a launch
    times.observe(set(), {"chat-2", "chat-3"}, now=160.0)
    assert times.estimate(30.0) == 10.0


def test_a_pool_that_sleeps_needs_engines_that_can() -> None:
    with pytest.raises(ValueError, match="--enable-sleep-mode"):
        PoolScaling(sleep_level=1)


NOISE = (0.0, 2.0, 1.0, 2.0, 0.0, 2.0)
"""One worker's worth of demand at a few requests a second, as one-second samples see it: the five-second mean
reads 1.17 (two workers at 1 each) although the load is one worker's."""


def noisy(t: int) -> float:
    return NOISE[t % len(NOISE)]


def test_noise_just_after_a_release_does_not_wake_the_worker_again() -> None:
    after_release = history(40, noisy, workers=1, sleeping=1)
    decision = decide(after_release, SLEEPS, PLANNED, now=40.0, last_change_at=35.0, last_action=Action.DOWN)
    assert decision.action is Action.HOLD, decision.reason
    # The same samples after a move up, or with no move yet, take no doubt: the mean alone asks for two.
    for last in (Action.UP, None):
        again = decide(after_release, SLEEPS, PLANNED, now=40.0, last_change_at=35.0, last_action=last)
        assert again.action is Action.UP and again.target == 2


def test_a_worker_that_must_start_is_not_doubted_on_the_way_up() -> None:
    # With no sleeping worker a doubted rise would wait a start-up more: the mean decides at once.
    after_release = history(40, noisy, workers=1)
    decision = decide(after_release, BOUNDS, PLANNED, now=40.0, last_change_at=35.0, last_action=Action.DOWN)
    assert decision.action is Action.UP and decision.target == 2


def test_a_real_rise_just_after_a_release_is_met() -> None:
    rise = history(40, lambda t: 2.5 + noisy(t) / 4, workers=1, sleeping=2)
    decision = decide(rise, SLEEPS, PLANNED, now=40.0, last_change_at=35.0, last_action=Action.DOWN)
    assert decision.action is Action.UP and decision.target >= 3


def test_the_doubt_fades_with_the_age_of_the_last_move() -> None:
    # Six five-second windows after the release the same noise is taken at its mean again.
    late = history(80, noisy, workers=1, sleeping=1)
    decision = decide(late, SLEEPS, PLANNED, now=80.0, last_change_at=49.0, last_action=Action.DOWN)
    assert decision.action is Action.UP and decision.target == 2
    early = decide(late, SLEEPS, PLANNED, now=80.0, last_change_at=75.0, last_action=Action.DOWN)
    assert early.action is Action.HOLD


def test_a_release_just_after_a_rise_needs_the_demand_clearly_below() -> None:
    # Three workers added 20 s ago (past the hold); the demand reads 1.7 on average, two workers' worth at 90 %.
    wobble = history(60, lambda t: 1.7 + (0.6 if t % 2 else -0.6), workers=3)
    undoubted = decide(wobble, BOUNDS, PLANNED.model_copy(update={"startup_s": 5.0}), now=60.0, last_change_at=40.0)
    assert undoubted.action is Action.DOWN and undoubted.target == 2
    doubted = decide(wobble, BOUNDS, PLANNED.model_copy(update={"startup_s": 5.0}), now=60.0, last_change_at=40.0,
                     last_action=Action.UP)
    assert doubted.action is Action.HOLD, doubted.reason


def test_standby_spares_sleep_and_leave_room_for_an_awake_worker() -> None:
    template = WorkerTemplate(extra_args=("--enable-sleep-mode",))
    with pytest.raises(ValueError, match="set sleep_level"):
        PoolScaling(standby_workers=1, template=template)
    with pytest.raises(ValueError, match="fewer than max_workers"):
        PoolScaling(max_workers=3, sleep_level=1, standby_workers=3, template=template)
    assert PoolScaling(max_workers=4, sleep_level=1, standby_workers=3, template=template).standby_workers == 3
