"""Coarse timers: callbacks run in their deadlines' order, at most a tick late; a cancelled one never runs and
does not stay in the heap; a failing callback is reported and the rest still run; one heap per loop."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import uvloop

from poolgate.kernel import coarse_timers as module
from poolgate.kernel.coarse_timers import TICK_S, coarse_timers


async def test_callbacks_run_in_deadline_order_at_most_a_tick_late_and_a_cancelled_one_never() -> None:
    loop = asyncio.get_running_loop()
    timers = coarse_timers()
    ran: list[tuple[str, float]] = []
    start = loop.time()
    for name, after in (("c", 0.06), ("a", 0.02), ("b", 0.04), ("never", 0.03)):
        handle = timers.call_at(start + after, lambda n: ran.append((n, loop.time())), name)
    handle.cancel()
    await asyncio.sleep(0.15)
    assert [name for name, _ in ran] == ["a", "b", "c"]
    for (_, fired), due in zip(ran, (0.02, 0.04, 0.06), strict=True):
        assert start + due <= fired <= start + due + TICK_S + 0.05  # a tick, and generous room for a busy host
    assert len(timers) == 0


async def test_deadlines_cancelled_long_before_their_time_do_not_pile_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(module, "COMPACT_AT", 100)
    timers = coarse_timers()
    now = asyncio.get_running_loop().time()
    for _ in range(1000):
        timers.call_at(now + 30, print).cancel()  # a request answered at once, with a 30 s deadline
    kept = timers.call_at(now + 0.02, lambda: None)
    await asyncio.sleep(3 * TICK_S)
    assert timers._heap == [] and timers.cancelled == 0 and kept.callback is None


async def test_a_failing_callback_is_reported_and_the_others_still_run() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: reported.append(context))
    ran = []
    now = loop.time()
    coarse_timers().call_at(now, lambda: 1 / 0)
    coarse_timers().call_at(now, ran.append, "after")
    await asyncio.sleep(3 * TICK_S)
    coarse_timers().call_at(loop.time(), ran.append, "next tick")
    await asyncio.sleep(3 * TICK_S)
    assert ran == ["after", "next tick"]
    assert isinstance(reported[0]["exception"], ZeroDivisionError)


def test_each_loop_has_its_own_heap_and_callers_on_one_share_it() -> None:
    async def timers_twice() -> tuple[object, object]:
        return coarse_timers(), coarse_timers()

    first, again = uvloop.run(timers_twice())
    other, _ = asyncio.run(timers_twice())
    assert first is again and first is not other
