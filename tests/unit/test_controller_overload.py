"""The loop-lag reading the registry API defers registrations by: the typical delay of the last second."""

from __future__ import annotations

import asyncio

from controller.overload import LoopLag


def test_lag_is_the_typical_delay_of_the_last_second_not_one_long_step() -> None:
    lag = LoopLag()
    for i in range(20):
        lag.record(i * 0.05, 0.3)
    assert lag.lag_s == 0.3
    lag.record(1.0, 2.0)  # one long step among delays of 0.3 s
    assert lag.lag_s == 0.3
    for i in range(21, 45):
        lag.record(i * 0.05, 0.0)  # caught up: the old samples leave the window
    assert lag.lag_s == 0.0


def test_a_loop_kept_busy_reads_as_behind() -> None:
    async def scenario() -> float:
        lag = LoopLag()
        sampler = asyncio.create_task(lag.run())
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.0
        while loop.time() < end:  # steps of 0.2 s with no chance for the sampler in between
            busy_until = loop.time() + 0.2
            while loop.time() < busy_until:
                pass
            await asyncio.sleep(0)
        sampler.cancel()
        return lag.lag_s

    measured = asyncio.run(scenario())
    print(f"lag read while the loop ran 0.2 s steps: {measured:.3f} s")
    assert measured > 0.1
