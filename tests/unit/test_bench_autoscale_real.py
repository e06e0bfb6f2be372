"""The real-process autoscale benchmark's pure parts: the plateau trace, the decisions it reads from the
controller's log, the direction changes per plateau and the GPU-seconds of each fleet."""

from __future__ import annotations

import datetime

from bench.autoscale_real import (
    AUTO,
    STATIC,
    Fleet,
    RealScenario,
    arrivals,
    decisions,
    direction_changes,
    lifecycle_times,
)


def test_trace_climbs_to_the_peak_and_back_with_a_ten_fold_trough() -> None:
    scenario = RealScenario(peak_rps=4.0, levels=(0.1, 0.5, 1.0, 0.5), plateau_s=10.0, cycles=2)
    plateaus = scenario.plateaus()
    assert len(plateaus) == 9 and scenario.duration_s == 90.0
    rates = [rate for _, _, rate in plateaus]
    assert max(rates) / min(rates) == 10.0 and rates[-1] == min(rates)
    times = arrivals(scenario)
    assert times == sorted(times) == arrivals(scenario)  # the same seeded draw every time
    per_plateau = [sum(1 for t in times if start <= t < end) for start, end, _ in plateaus]
    assert per_plateau[2] > 5 * per_plateau[0]


def test_decisions_and_drains_are_read_from_the_controller_log() -> None:
    start = datetime.datetime(2026, 1, 1, 12, 0, 0)

    def line(seconds: float, text: str) -> str:
        stamp = (start + datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]
        return f"{stamp} INFO poolgate.controller.autoscale: {text}"

    log = "\n".join([
        line(3.5, "pool auto: scale up to 2 (3.0 waiting per worker > 1 for 2 s)"),
        line(4.0, "pool static: scale up to 9 (not this pool)"),
        line(12.25, "pool auto: scale down to 1 (idle for 10 s: nothing waiting)"),
        "2026-01-01 12:00:12,300 INFO poolgate.controller.instances: pool auto: 2 -> 1 workers, draining auto-w2",
    ])
    made, drained = decisions(log, start.timestamp())
    assert [(d["at_s"], d["action"], d["target"]) for d in made] == [(3.5, "up", 2), (12.25, "down", 1)]
    assert drained == {"auto-w2"}


def test_direction_changes_count_reversals_inside_each_plateau() -> None:
    scenario = RealScenario(levels=(0.1, 1.0), plateau_s=10.0, cycles=1)
    made = [{"at_s": 1.0, "action": "up"}, {"at_s": 2.0, "action": "down"}, {"at_s": 3.0, "action": "up"},
            {"at_s": 11.0, "action": "up"}, {"at_s": 15.0, "action": "up"}, {"at_s": 25.0, "action": "down"}]
    assert direction_changes(scenario, made) == [2, 0, 0]


def test_gpu_seconds_count_every_live_worker_from_the_trace_start() -> None:
    fleet = Fleet()
    fleet.note(-0.5, {"static-1": 1, "auto-w1": 2})  # before the trace: not counted
    for step in range(4):
        alive = {"static-1": 1, "static-2": 2, "auto-w1": 3} | ({"auto-w2": 4} if step >= 2 else {})
        fleet.note(step * 0.5, alive)
    assert fleet.gpu_seconds(STATIC) == 4.0 and fleet.gpu_seconds(AUTO) == 3.0
    assert fleet.seen["auto-w2"] == (1.0, 1.5)


def test_seconds_asleep_are_counted_apart_from_gpu_seconds() -> None:
    fleet = Fleet()
    for step in range(4):
        fleet.note(step * 0.5, {"auto-w1": 1, "auto-w2": 2}, sleeping={"auto-w2"} if step >= 2 else set())
    assert fleet.gpu_seconds(AUTO) == 3.0 and fleet.asleep_seconds() == 1.0


def test_start_ups_and_wake_ups_are_read_from_the_controller_log() -> None:
    log = "\n".join([
        "x INFO poolgate.controller.autoscale: pool auto: worker auto-2 served 9.3 s after it was first seen "
        "starting (start-up now 9.3 s)",
        "x INFO poolgate.controller.instances: pool auto: 1 -> 2 workers, woke auto-2 in 1.02 s, started none",
        "x INFO poolgate.controller.instances: pool auto: 2 -> 3 workers, woke none, started auto-3",
    ])
    assert lifecycle_times(log) == {"startups_s": [9.3], "wakeups_s": [1.02]}
