"""Autoscaling decisions over a metrics history: sustained pressure, bounds, cooldown, starting workers."""

from __future__ import annotations

from controller.autoscale import Action, PoolSample, decide
from poolgate.kernel.config import AutoscaleSettings, PoolScaling

SETTINGS = AutoscaleSettings(up_waiting_per_worker=2.0, up_kv_usage=0.85, up_sustain_s=3.0,
                             down_running_per_worker=4.0, down_cooldown_s=10.0)
BOUNDS = PoolScaling(min_workers=1, max_workers=6)


def history(seconds: int, workers: int, waiting: int, running: int = 8, kv: float = 0.3,
            ready: int | None = None) -> list[PoolSample]:
    return [PoolSample(float(t), workers, workers if ready is None else ready, waiting, running, kv)
            for t in range(seconds + 1)]


def test_sustained_waiting_scales_up_in_proportion_to_the_backlog() -> None:
    decision = decide(history(4, 2, waiting=12), BOUNDS, SETTINGS, now=4.0, last_change_at=None)
    assert decision.action is Action.UP and decision.target == 4  # doubling at most per move
    assert "waiting per worker" in decision.reason


def test_pressure_must_last_the_sustain_window() -> None:
    samples = history(4, 2, waiting=12)
    samples[2] = PoolSample(2.0, 2, 2, 0, 8, 0.3)
    assert decide(samples, BOUNDS, SETTINGS, now=4.0, last_change_at=None).action is Action.HOLD
    assert decide(history(2, 2, waiting=12), BOUNDS, SETTINGS, now=2.0, last_change_at=None).action is Action.HOLD


def test_kv_pressure_scales_up() -> None:
    decision = decide(history(4, 2, waiting=0, kv=0.9), BOUNDS, SETTINGS, now=4.0, last_change_at=None)
    assert decision.action is Action.UP and decision.target == 3 and "KV usage" in decision.reason


def test_no_second_scale_up_while_a_worker_starts() -> None:
    decision = decide(history(4, 3, waiting=12, ready=2), BOUNDS, SETTINGS, now=4.0, last_change_at=None)
    assert decision.action is Action.HOLD and "starting" in decision.reason


def test_max_bound_holds() -> None:
    decision = decide(history(4, 6, waiting=100), BOUNDS, SETTINGS, now=4.0, last_change_at=None)
    assert decision.action is Action.HOLD and "max_workers" in decision.reason


def test_idle_after_cooldown_scales_down_one() -> None:
    decision = decide(history(12, 3, waiting=0, running=5), BOUNDS, SETTINGS, now=12.0, last_change_at=None)
    assert decision.action is Action.DOWN and decision.target == 2 and "idle" in decision.reason


def test_no_scale_down_within_cooldown_or_when_load_needs_the_workers() -> None:
    assert decide(history(12, 3, waiting=0, running=5), BOUNDS, SETTINGS, now=12.0,
                  last_change_at=5.0).action is Action.HOLD
    assert decide(history(12, 3, waiting=0, running=9), BOUNDS, SETTINGS, now=12.0,
                  last_change_at=None).action is Action.HOLD
    assert decide(history(12, 1, waiting=0, running=0), BOUNDS, SETTINGS, now=12.0,
                  last_change_at=None).action is Action.HOLD


def test_bounds_are_restored_first() -> None:
    assert decide(history(0, 0, waiting=0), BOUNDS, SETTINGS, now=0.0, last_change_at=None).target == 1
    assert decide(history(0, 8, waiting=0), BOUNDS, SETTINGS, now=0.0, last_change_at=None).target == 6
