"""The sweep's traces: the real benchmark's staircase and a trough with bursts to the peak."""

from __future__ import annotations

from bench.autoscale_sweep import TRACES, Bursty, Plateaus


def test_the_plateaus_climb_to_the_peak_and_end_in_the_trough() -> None:
    trace = TRACES["plateaus"]
    assert isinstance(trace, Plateaus)
    rates = [trace.rate(t + 1.0) for t in range(0, int(trace.period_s), int(trace.plateau_s))]
    assert rates[:4] == [0.4, 1.0, 2.0, 4.0] and rates[-1] == 0.4 and len(rates) == 13


def test_bursts_reach_the_peak_and_fall_back_to_the_trough() -> None:
    trace = Bursty(period_s=1800.0, peak_rps=30.0, seed=7)
    rates = {trace.rate(float(t)) for t in range(1800)}
    assert rates == {3.0, 30.0}
    assert trace.rate(100.0) == trace.rate(100.0)  # the same bursts every time


def test_the_sixty_second_plateaus_are_the_real_runs_longer_shape() -> None:
    trace = TRACES["plateaus-60s"]
    assert isinstance(trace, Plateaus)
    rates = [trace.rate(t + 1.0) for t in range(0, int(trace.period_s), 60)]
    assert rates == [0.4, 1.0, 2.0, 4.0, 2.0, 1.0] * 3 + [0.4]


def test_reversals_are_counted_inside_each_plateau_only() -> None:
    trace = TRACES["plateaus"]
    assert isinstance(trace, Plateaus)
    # Up at the end of one plateau and down at the start of the next is no flapping; up, down, up inside one is two.
    assert trace.most_reversals([(14.0, "up"), (16.0, "down")]) == 0
    assert trace.most_reversals([(31.0, "up"), (35.0, "down"), (40.0, "up"), (50.0, "up")]) == 2
    assert trace.most_reversals([]) == 0
