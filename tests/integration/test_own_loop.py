"""A controller duty on a loop of its own (the health monitor's): it runs beside the controller's loop, calls
back into it, stops with it, and a duty that fails is not lost silently."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import pytest

from controller.own_loop import SWITCH_INTERVAL_S, CallOnLoop, run_on_own_loop


async def test_a_duty_runs_on_its_own_thread_calls_back_and_stops_with_the_controller() -> None:
    controller_thread = threading.get_ident()
    call_here = CallOnLoop(asyncio.get_running_loop())
    seen: dict[str, object] = {}
    answered = threading.Event()

    async def on_controller_loop(value: int) -> int:
        seen["callback_thread"] = threading.get_ident()
        return value * 2

    async def duty(stop: asyncio.Event) -> None:
        seen["duty_thread"] = threading.get_ident()
        seen["answer"] = await call_here(on_controller_loop(21))
        answered.set()
        await stop.wait()
        seen["stopped"] = True

    stop = asyncio.Event()
    running = asyncio.create_task(run_on_own_loop("test-duty", duty, stop))
    assert await asyncio.to_thread(answered.wait, 10)
    assert seen["duty_thread"] != controller_thread
    assert seen["callback_thread"] == controller_thread
    assert seen["answer"] == 42
    stop.set()
    await asyncio.wait_for(running, 10)
    assert seen.get("stopped") is True
    assert not any(t.name == "test-duty" for t in threading.enumerate())


async def test_the_controllers_loop_is_not_held_up_by_a_busy_duty() -> None:
    """A duty that keeps its loop busy (callbacks back to back, as probes at 8,000 a second do) delays the
    controller's timers by at most a few interpreter switch intervals, not by the duty's whole burst."""

    async def busy(stop: asyncio.Event) -> None:
        while not stop.is_set():
            end = time.perf_counter() + 0.2
            while time.perf_counter() < end:  # 200 ms of work without yielding its loop
                pass
            await asyncio.sleep(0)

    stop = asyncio.Event()
    running = asyncio.create_task(run_on_own_loop("busy-duty", busy, stop))
    default = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as the controller sets it
    try:
        lateness = []
        for _ in range(20):
            asked = time.perf_counter()
            await asyncio.sleep(0.01)
            lateness.append(time.perf_counter() - asked - 0.01)
    finally:
        sys.setswitchinterval(default)
        stop.set()
    await asyncio.wait_for(running, 10)
    print(f"controller timer lateness beside a busy duty: median {sorted(lateness)[10] * 1000:.1f} ms, "
          f"max {max(lateness) * 1000:.1f} ms")
    assert sorted(lateness)[10] < 0.1  # on one loop each sleep would wait out the 200 ms burst


async def test_a_duty_that_fails_raises_in_the_controller() -> None:
    async def failing(stop: asyncio.Event) -> None:
        raise RuntimeError("probe client could not start")

    with pytest.raises(RuntimeError, match="could not start"):
        await asyncio.wait_for(run_on_own_loop("failing-duty", failing, asyncio.Event()), 10)


async def test_cancelling_the_controllers_task_stops_the_duty() -> None:
    stopped = threading.Event()

    async def duty(stop: asyncio.Event) -> None:
        await stop.wait()
        stopped.set()

    running = asyncio.create_task(run_on_own_loop("cancelled-duty", duty, asyncio.Event()))
    await asyncio.sleep(0.1)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert stopped.is_set()
    assert not any(t.name == "cancelled-duty" for t in threading.enumerate())
