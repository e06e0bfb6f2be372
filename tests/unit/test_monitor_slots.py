"""The health monitor's probe slots: at most as many probes in flight as slots, waiters served in order, and a
slot handed to a waiter that is cancelled at that moment goes on to the next instead of being lost."""

from __future__ import annotations

import asyncio

import pytest

from controller.monitor import _Slots


async def test_waiters_get_slots_in_order_and_never_more_than_there_are() -> None:
    slots = _Slots(2)
    await slots.acquire()
    await slots.acquire()
    waiters = [asyncio.create_task(slots.acquire()) for _ in range(3)]
    await asyncio.sleep(0.01)
    assert not any(waiter.done() for waiter in waiters)
    for served in range(3):
        slots.release()
        await asyncio.wait_for(waiters[served], 1)
        await asyncio.sleep(0.01)
        assert [waiter.done() for waiter in waiters] == [i <= served for i in range(3)]


async def test_a_slot_handed_to_a_cancelled_waiter_goes_to_the_next() -> None:
    slots = _Slots(1)
    await slots.acquire()
    first, second = asyncio.create_task(slots.acquire()), asyncio.create_task(slots.acquire())
    await asyncio.sleep(0)
    slots.release()  # handed to the first waiter ...
    first.cancel()  # ... cancelled before it could run
    with pytest.raises(asyncio.CancelledError):
        await first
    await asyncio.wait_for(second, 1)  # the slot went on
    slots.release()
    await asyncio.wait_for(slots.acquire(), 1)  # and no slot was lost or made up on the way
    assert not asyncio.create_task(slots.acquire()).done()
