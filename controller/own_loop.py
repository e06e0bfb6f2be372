"""A duty of the controller on an event loop of its own, in a thread of the controller's process.

The health monitor at 10,000 workers probes 5,000 workers a second, about half a core. On the
controller's loop every probe's answer was a callback queued ahead of the xDS bridge's, so one worker's
change reached Envoy behind hundreds of them. On a loop of its own, the bridge waits at most one
interpreter switch interval (``SWITCH_INTERVAL_S``) for the monitor's thread to let go. ``poolgate bench
scale`` at 10,000 workers in 200 pools, three runs of each side by side: one change's p99 fell from 129-179 ms
to 67-95 ms, and its slowest time from Redis to every Envoy from 124-178 ms to 48-61 ms.

Nothing bound to a loop may cross: the duty builds its own Redis client and HTTP clients on its loop, and
calls back into the controller's loop only through ``CallOnLoop``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import uvloop

log = logging.getLogger("poolgate.controller")

SWITCH_INTERVAL_S = 0.001
"""The interpreter's switch interval in a process with a duty on its own loop (CPython's default: 5 ms): a
thread that wants the interpreter waits this long at most for a busy one to let go, and each step of a
change on its way to Envoy (the announcement, two Redis answers, the push) may wait once."""
JOIN_TIMEOUT_S = 10.0
"""How long the controller waits for the thread to end once asked to stop (a remedy under way finishes)."""

T = TypeVar("T")


class CallOnLoop:
    """Runs coroutines on ``loop`` (the controller's) for code on another loop, and waits for their result."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def __call__(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))


async def run_on_own_loop(name: str, duty: Callable[[asyncio.Event], Awaitable[None]], stop: asyncio.Event) -> None:
    """Run ``duty(own_stop)`` on a new event loop in the thread ``name`` until ``stop`` is set or this task is
    cancelled (then ``own_stop`` is set on the duty's loop and the thread is waited for), or until the duty
    ends by itself (its exception is raised here)."""
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[Any] = loop.create_future()
    started: concurrent.futures.Future[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = concurrent.futures.Future()

    async def body() -> None:
        own_stop = asyncio.Event()
        started.set_result((asyncio.get_running_loop(), own_stop))
        await duty(own_stop)

    def finish(error: BaseException | None) -> None:
        if ended.done():
            return
        if error is None:
            ended.set_result(None)
        elif stop.is_set():  # failed while stopping: nobody waits for it any more
            log.warning("%s ended with %r while stopping", name, error)
            ended.set_result(None)
        else:
            ended.set_exception(error)

    def thread_main() -> None:
        error: BaseException | None = None
        try:
            uvloop.run(body())
        except BaseException as exc:  # handed to the controller's loop, which raises it in this task
            error = exc
            if not started.done():
                started.set_exception(exc)
        if not loop.is_closed():
            loop.call_soon_threadsafe(finish, error)

    thread = threading.Thread(target=thread_main, name=name, daemon=True)
    thread.start()
    own_loop, own_stop = await asyncio.wrap_future(started)
    stopping: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([stopping, ended], return_when=asyncio.FIRST_COMPLETED)
        if ended.done():
            ended.result()  # the duty's own end: its exception, if it raised one
    finally:
        stopping.cancel()
        if thread.is_alive():
            try:
                own_loop.call_soon_threadsafe(own_stop.set)
            except RuntimeError:  # its loop closed meanwhile: the thread is ending anyway
                pass
            await asyncio.to_thread(thread.join, JOIN_TIMEOUT_S)
            if thread.is_alive():
                log.warning("%s did not end within %.0f s of the stop", name, JOIN_TIMEOUT_S)
