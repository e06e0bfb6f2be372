"""Living through a Redis outage: say it once, and do not take a Redis that came back empty at its word.

Every long-running reader of the fleet (the controller's xDS bridge and health monitor, the agent,
extproc's snapshot refresh) keeps working on what it last knew while Redis is away; ``OutageLog`` is their
one down/up state machine (one log line when it goes, one when it is back, an optional gauge), and
``ReturnGrace`` their one rule for the first reads after it returns.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from redis.exceptions import RedisClusterException, RedisError

from poolgate.kernel.fleet import WorkerRecord

REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError)
"""What a Redis call raises when Redis is away or slow (``TimeoutError`` is an ``OSError``; a Cluster client
that reaches no node raises ``RedisClusterException``)."""


class OutageLog:
    """A dependency's reachability, logged on each change only. ``down`` takes a %-format with one ``%s``
    for the error; ``on_change`` (e.g. a gauge's setter) hears every change, the first report included."""

    def __init__(self, log: logging.Logger, down: str, up: str, *, up_level: int = logging.INFO,
                 on_change: Callable[[bool], None] | None = None) -> None:
        self._log = log
        self._down = down
        self._up = up
        self._up_level = up_level
        self._on_change = on_change
        self._reachable: bool | None = None
        """None until the first report."""

    def down(self, exc: BaseException) -> None:
        if self._reachable is False:
            return
        self._log.warning(self._down, exc)
        self._changed(False)

    def up(self) -> bool:
        """Report success; True when this ends an outage (not on the first report)."""
        if self._reachable is True:
            return False
        returned = self._reachable is False
        if returned:
            self._log.log(self._up_level, self._up)
        self._changed(True)
        return returned

    def _changed(self, reachable: bool) -> None:
        self._reachable = reachable
        if self._on_change is not None:
            self._on_change(reachable)


class ReturnGrace:
    """For ``grace_s`` after Redis comes back, workers read before the outage and missing now are kept.

    A Redis that came back without its data is not a fleet that left: workers re-register one by one with
    their next heartbeats, within a TTL. Until then the last known workers the registry does not list yet
    are carried over, as fresh as they were when last read (``updated_at`` moves on by the time since that
    read): their heartbeats went to a Redis that was away or lost them, so their age says nothing.
    """

    def __init__(self, grace_s: float) -> None:
        self._grace_s = grace_s
        self._until = float("-inf")
        self._last: Sequence[WorkerRecord] = ()
        self._last_at = float("-inf")

    def redis_returned(self, now: float) -> None:
        self._until = now + self._grace_s

    def fill_in(self, records: Sequence[WorkerRecord], now: float) -> list[WorkerRecord]:
        """``records`` (read at ``now``) plus, within the grace period, the carried-over workers."""
        merged = list(records)
        if now < self._until:
            listed = {r.id for r in records}
            carried_for = now - self._last_at
            merged += [replace(w, updated_at=w.updated_at + carried_for) for w in self._last if w.id not in listed]
        self._last, self._last_at = merged, now
        return merged
