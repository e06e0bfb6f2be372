"""The wake-up benchmark's reading of the controller's log: when the controller acted on a request for a pool at
zero, and what the launch or the wake-up then took; and its targets."""

from __future__ import annotations

import datetime

from bench.autoscale_wake import Round, WakeScenario, lifecycle, targets

LOG = """\
2026-12-05 01:30:45,801 INFO poolgate.controller.autoscale: pool cold: scale up to 1 (1 request(s) waiting)
2026-12-05 01:30:45,801 INFO poolgate.controller.instances: pool cold: 0 -> 1 workers, woke none, started cold-w1
2026-12-05 01:30:46,100 INFO poolgate.controller.local: worker other-w9 is ready at 127.0.0.1:5000
2026-12-05 01:30:54,593 INFO poolgate.controller.local: worker cold-w1 is ready at 127.0.0.1:52811
2026-12-05 01:31:40,947 INFO poolgate.controller.instances: pool sleepy: 0 -> 1 workers, woke sleepy-w2 in 1.00 s, \
started none
"""


def at(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_a_launch_is_timed_from_its_start_to_its_worker_ready_and_a_wake_up_by_its_call() -> None:
    acted, engine = lifecycle(LOG, "cold", at("2026-12-05 01:30:45,700"))
    assert round(acted or 0, 3) == 0.101 and round(engine or 0, 3) == 8.792
    acted, engine = lifecycle(LOG, "sleepy", at("2026-12-05 01:31:39,900"))
    assert round(acted or 0, 3) == 0.047 and engine == 1.0  # the line is written once the call returned
    assert lifecycle(LOG, "cold", at("2026-12-05 01:35:00,000")) == (None, None)  # nothing after the request


def test_targets_compare_a_launch_with_its_start_up_and_a_wake_up_with_two_seconds() -> None:
    launch = Round("cold", 1, "launch", ttft_s=9.5, status=200, acted_s=0.1, engine_s=8.7)
    wake = Round("sleepy", 2, "wake-up", ttft_s=1.1, status=200, acted_s=0.05, engine_s=1.0)
    assert targets(WakeScenario(), [launch, wake]) == {"from_zero_within_startup_plus_1s": True,
                                                        "from_sleep_within_2s": True}
    late = Round("cold", 2, "launch", ttft_s=9.8, status=200, acted_s=0.9, engine_s=8.7)
    slow_wake = Round("sleepy", 3, "wake-up", ttft_s=2.4, status=200, acted_s=1.2, engine_s=1.0)
    assert targets(WakeScenario(), [launch, late, wake, slow_wake]) == {"from_zero_within_startup_plus_1s": False,
                                                                         "from_sleep_within_2s": False}
