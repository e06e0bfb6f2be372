"""Stop signals start a graceful stop with a hard deadline.

A graceful stop can hang where Python cannot help it: grpc.aio's server stop is known to hang now and then
when a stream was cancelled at the wrong moment, and a hung process keeps its port and holds up a rolling
update until the orchestrator kills it. The deadline is enforced by ``faulthandler``'s watchdog, a C
thread that needs neither the event loop nor the GIL: it writes every thread's stack to stderr (so the
hang can be diagnosed) and exits with status 1.
"""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_stop_signal(loop: asyncio.AbstractEventLoop, begin_stop: Callable[[], object], deadline_s: float) -> None:
    """On SIGINT or SIGTERM call ``begin_stop`` and give the process ``deadline_s`` seconds to exit.

    The first signal arms the deadline; later ones neither postpone it nor start another stop."""
    armed = False

    def handle() -> None:
        nonlocal armed
        if armed:
            return
        armed = True
        print(f"stopping: exiting within {deadline_s:g} s", file=sys.stderr, flush=True)
        faulthandler.dump_traceback_later(deadline_s, exit=True)
        begin_stop()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, handle)
