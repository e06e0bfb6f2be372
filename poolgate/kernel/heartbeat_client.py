"""A worker's side of the registry protocol: register once, then heartbeat at the interval each answer names.

The registry answers every registration and heartbeat with ``heartbeat_interval_s`` (when to beat next, paced to
the fleet's size: ``controller/heartbeat_interval.py``) and ``heartbeat_ttl_s`` (when it forgets a worker that
stopped). A client that kept its own fixed interval would hold a large fleet at the rate that overloads the
registry, so this one takes each answer's interval; only until the first answer does it use the configured one.
A registry that does not answer (restarting, failing over) is asked again at the last interval it named, never
faster: a fleet whose registry comes back returns at its usual pace, not all at once. Only an answer that says
"not registered" (404: the registry forgot the worker) makes it register again; a put-off registration (503)
comes back after the ``Retry-After`` it was given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

log = logging.getLogger("poolgate.heartbeats")

CALL_TIMEOUT_S = 10.0
"""A registration or heartbeat that takes longer counts as unanswered (asked again at the interval)."""


@dataclass
class HeartbeatStats:
    """What a worker's heartbeats met so far (for its logs, tests and benchmarks)."""

    registrations: int = 0
    heartbeats: int = 0
    unanswered: int = 0
    """Calls the registry did not answer (down, restarting) or answered with an error other than 404/503."""
    interval_s: float = 0.0
    """The interval the registry named last."""
    ttl_s: float = 0.0
    """The TTL the registry named last."""


def answered_pace(answer: Mapping[str, Any], interval_s: float, ttl_s: float) -> tuple[float, float]:
    """The (interval, TTL) an answer names; the ones given where it names none (an older registry)."""
    named_interval = answer.get("heartbeat_interval_s")
    named_ttl = answer.get("heartbeat_ttl_s")
    return (float(named_interval) if isinstance(named_interval, int | float) and named_interval > 0 else interval_s,
            float(named_ttl) if isinstance(named_ttl, int | float) and named_ttl > 0 else ttl_s)


class WorkerHeartbeats:
    """Keeps one worker registered with the registry API at ``api_url`` (``registration`` is the body of
    ``POST /v1/workers``) until ``run``'s ``stop``; ``interval_s`` and ``ttl_s`` stand until the first answer."""

    def __init__(self, api_url: str, token: str, registration: Mapping[str, Any], interval_s: float = 0.5,
                 ttl_s: float = 1.5, tls: ssl.SSLContext | None = None) -> None:
        self._api_url = api_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        self._registration = orjson.dumps(dict(registration))
        self._worker_id = str(registration["id"])
        self._tls = tls
        self.stats = HeartbeatStats(interval_s=interval_s, ttl_s=ttl_s)

    async def run(self, stop: asyncio.Event, facts: Mapping[str, Any] | None = None) -> None:
        """Register, then heartbeat (reporting ``facts``, read at each beat) until ``stop``."""
        timeout = aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout, headers=self._headers,
                                         connector=aiohttp.TCPConnector(ssl=self._tls or True)) as http:
            registered = False
            while not stop.is_set():
                if registered:
                    registered = await self._beat(http, dict(facts or {}))
                    wait_s = self.stats.interval_s if registered else 0.0
                else:
                    registered, wait_s = await self._register(http)
                if wait_s > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait_s)

    async def _register(self, http: aiohttp.ClientSession) -> tuple[bool, float]:
        """(registered, how long to wait before the next call)."""
        try:
            async with http.post(f"{self._api_url}/v1/workers", data=self._registration) as answer:
                body = await answer.read()
                if answer.status == 201:
                    self.stats.registrations += 1
                    self._take_pace(body)
                    return True, self.stats.interval_s
                retry_after = answer.headers.get("Retry-After", "")
                if answer.status == 503 and retry_after.isdigit():
                    return False, float(retry_after)
                log.warning("worker %s: registration refused (%d): %s", self._worker_id, answer.status,
                            body[:200].decode(errors="replace"))
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("worker %s: the registry did not answer the registration (%s)", self._worker_id, exc)
        self.stats.unanswered += 1
        return False, self.stats.interval_s

    async def _beat(self, http: aiohttp.ClientSession, facts: dict[str, Any]) -> bool:
        """One heartbeat; False only when the registry no longer knows the worker (register again)."""
        try:
            async with http.post(f"{self._api_url}/v1/workers/{self._worker_id}/heartbeat",
                                 data=orjson.dumps(facts)) as answer:
                body = await answer.read()
                if answer.status == 200:
                    self.stats.heartbeats += 1
                    self._take_pace(body)
                    return True
                if answer.status == 404:
                    log.info("worker %s: the registry forgot it; registering again", self._worker_id)
                    return False
                log.warning("worker %s: heartbeat answered %d", self._worker_id, answer.status)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("worker %s: the registry did not answer a heartbeat (%s)", self._worker_id, exc)
        self.stats.unanswered += 1
        return True  # still registered as far as anyone knows: ask again at the same pace

    def _take_pace(self, body: bytes) -> None:
        with contextlib.suppress(orjson.JSONDecodeError):
            answer = orjson.loads(body)
            if isinstance(answer, dict):
                self.stats.interval_s, self.stats.ttl_s = answered_pace(answer, self.stats.interval_s,
                                                                        self.stats.ttl_s)
