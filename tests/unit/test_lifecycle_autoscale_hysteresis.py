"""Autoscaling on TTFT, from and to zero, and without flapping on a steady load near a threshold.

The steady-load cases drive the pure decision with a pool whose numbers follow from an offered
concurrency: ``C`` requests in flight over ``n`` ready workers of ``capacity`` slots each run
``min(C, n × capacity)`` and queue the rest; a worker added is ready ``start_s`` later, one removed leaves
at once (its drain is the controller's). This is a check of the decision rule's hysteresis, not a
measurement of the autoscaler (that needs real processes).
"""

from __future__ import annotations

import itertools

import pytest

from controller.autoscale import Action, PoolSample, decide
from poolgate.kernel.config import AutoscaleSettings, PoolScaling

SETTINGS = AutoscaleSettings(up_waiting_per_worker=2.0, up_kv_usage=0.85, up_sustain_s=3.0,
                             down_running_per_worker=4.0, down_cooldown_s=10.0)
TTFT_SETTINGS = SETTINGS.model_copy(update={"up_ttft_s": 1.0})
TO_ZERO = PoolScaling(min_workers=0, max_workers=4)


def steady(seconds: int, workers: int, *, waiting: int = 0, running: int = 4, ttft: float = -1.0,
           kv: float = 0.3) -> list[PoolSample]:
    return [PoolSample(float(t), workers, workers, waiting, running, kv, ttft) for t in range(seconds + 1)]


def test_slow_first_tokens_scale_up_while_requests_run() -> None:
    decision = decide(steady(4, 2, ttft=1.6), TO_ZERO, TTFT_SETTINGS, now=4.0, last_change_at=None)
    assert decision.action is Action.UP and decision.target == 3 and "TTFT 1.60 s > 1 s" in decision.reason
    assert decide(steady(4, 2, ttft=1.6), TO_ZERO, SETTINGS, now=4.0,
                  last_change_at=None).action is Action.HOLD  # off by default


def test_a_stale_ttft_of_an_idle_pool_is_no_pressure() -> None:
    idle = steady(12, 2, running=0, ttft=3.0)  # the EWMA of the last burst, no request since
    decision = decide(idle, TO_ZERO, TTFT_SETTINGS, now=12.0, last_change_at=None)
    assert decision.action is Action.DOWN and decision.target == 1


def test_a_worker_leaves_only_once_ttft_is_well_below_its_target() -> None:
    assert decide(steady(12, 3, ttft=0.8), TO_ZERO, TTFT_SETTINGS, now=12.0,
                  last_change_at=None).action is Action.HOLD  # below the target, not below half of it
    assert decide(steady(12, 3, ttft=0.4), TO_ZERO, TTFT_SETTINGS, now=12.0,
                  last_change_at=None).action is Action.DOWN


def test_an_empty_pool_gets_a_worker_for_its_first_waiting_request_at_once() -> None:
    decision = decide(steady(0, 0, waiting=1, running=0), TO_ZERO, SETTINGS, now=0.0, last_change_at=None)
    assert decision.action is Action.UP and decision.target == 1 and "empty pool" in decision.reason
    assert decide(steady(30, 0, running=0), TO_ZERO, SETTINGS, now=30.0,
                  last_change_at=None).action is Action.HOLD  # nothing asked: stays at zero


def test_an_idle_pool_returns_to_zero_after_its_cooldown() -> None:
    assert decide(steady(12, 1, running=0), TO_ZERO, SETTINGS, now=12.0,
                  last_change_at=None).target == 0
    assert decide(steady(12, 1, running=1), TO_ZERO, SETTINGS, now=12.0,
                  last_change_at=None).action is Action.HOLD  # a running request keeps its worker


def simulate(concurrency: int, *, capacity: int, start_workers: int, start_s: int = 5, seconds: int = 400,
             settings: AutoscaleSettings = SETTINGS) -> list[int]:
    """The pool's size each second under a constant offered concurrency."""
    bounds = PoolScaling(min_workers=1, max_workers=12)
    ready_at = [0.0] * start_workers
    history: list[PoolSample] = []
    last_change: float | None = None
    sizes = []
    for t in range(seconds):
        now = float(t)
        ready = sum(1 for at in ready_at if at <= now)
        running = min(concurrency, ready * capacity)
        kv = running / (ready * capacity) * 0.8 if ready else 0.0
        history.append(PoolSample(now, len(ready_at), ready, concurrency - running, running, kv))
        history = [s for s in history if now - s.at <= 15.0]
        decision = decide(history, bounds, settings, now, last_change)
        if decision.action is Action.UP:
            ready_at += [now + start_s] * (decision.target - len(ready_at))
            last_change = now
        elif decision.action is Action.DOWN:
            ready_at = sorted(ready_at)[:decision.target]
            last_change = now
        sizes.append(len(ready_at))
    return sizes


def direction_changes(sizes: list[int]) -> int:
    steps = [b - a for a, b in itertools.pairwise(sizes) if b != a]
    return sum(1 for a, b in itertools.pairwise(steps) if (a > 0) != (b > 0))


@pytest.mark.parametrize("concurrency", range(1, 41))
@pytest.mark.parametrize("start_workers", [1, 6])
def test_a_steady_load_settles_without_flapping(concurrency: int, start_workers: int) -> None:
    """From too few or too many workers: moves in one direction only, then holds."""
    sizes = simulate(concurrency, capacity=8, start_workers=start_workers)
    assert direction_changes(sizes) == 0, sizes
    assert len(set(sizes[-100:])) == 1  # settled well before the end


def with_waiting(samples: list[PoolSample], busy_at: set[int]) -> list[PoolSample]:
    """``samples`` with one request waiting at the given seconds (a request that waited an engine step)."""
    return [PoolSample(s.at, s.workers, s.ready, 1 if int(s.at) in busy_at else 0, s.running, s.kv_usage)
            for s in samples]


def test_a_request_waiting_one_step_does_not_hold_a_pool_at_its_peak() -> None:
    """11 samples over the cooldown, one with a request waiting: the pool still shrinks, and says how idle it
    was; three such samples, or one in the latest, hold it."""
    one_blip = with_waiting(steady(10, 3, running=4), {4})
    decision = decide(one_blip, TO_ZERO, SETTINGS, now=10.0, last_change_at=None)
    assert decision.action is Action.DOWN and decision.target == 2 and "10 of 11 samples" in decision.reason
    held = decide(with_waiting(steady(10, 3, running=4), {2, 5, 8}), TO_ZERO, SETTINGS, now=10.0,
                  last_change_at=None)
    assert held.action is Action.HOLD and "8 of 11 samples" in held.reason and "1 waiting" in held.reason
    assert decide(with_waiting(steady(10, 3, running=4), {10}), TO_ZERO, SETTINGS, now=10.0,
                  last_change_at=None).action is Action.HOLD
