"""Cancelling tasks that talk to Redis, and waiting until they have really ended.

redis-py's asyncio client can swallow a ``CancelledError`` that arrives while a command is under way (a
long-known issue of that client): the task then runs on as if it had never been cancelled. Here, with
redis-py 8.1, a third of the tasks cancelled in a loop of single reads ran on, and so did a drain that its
controller stopped (it went on polling until its worker's record expired). One cancel and a wait are not
enough: ``cancel_and_wait`` cancels again every ``RETRY_S`` until every task has ended.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

RETRY_S = 0.05


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]], retry_s: float = RETRY_S) -> None:
    """Cancel ``tasks`` until each has ended; what they raised is taken and dropped (as ``gather`` with
    ``return_exceptions`` would), so none is reported as never retrieved."""
    tasks = list(tasks)
    running = {task for task in tasks if not task.done()}
    while running:
        for task in running:
            task.cancel()
        _, running = await asyncio.wait(running, timeout=retry_s)
    for task in tasks:
        if not task.cancelled():
            task.exception()
