"""Coalesces the registry API's single-worker heartbeats into one Redis pipeline per turn of the event loop.

At 1,000 workers beating every 0.5 s the API takes 2,000 heartbeats a second. Sent one by one, each pays
redis-py's whole per-command path (pool checkout, retry wrapper, timeouts, its own round trip); gathered,
the heartbeats that arrive while one batch is in Redis leave together in the next (``heartbeat_many``: one
pipeline, the same script per worker, so a state change is still announced at once). Under light load a
batch holds one heartbeat and costs what a single one did; under heavy load batches grow and the cost per
heartbeat falls, instead of queueing until workers expire.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from poolgate.kernel.store import FleetStore

log = logging.getLogger(__name__)

MAX_BATCH = 2000
"""Heartbeats per pipeline at most (a larger backlog goes in the next)."""


class HeartbeatCoalescer:
    """``beat`` answers whether the worker is registered, as ``FleetStore.heartbeat`` does."""

    def __init__(self, store: FleetStore, ttl_s: float) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._waiting: dict[str, tuple[dict[str, Any], list[asyncio.Future[bool]]]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0
        """Pipelines sent so far (for tests and the benchmark)."""

    async def beat(self, worker_id: str, facts: Mapping[str, Any]) -> bool:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        waiting = self._waiting.get(worker_id)
        if waiting is None:
            self._waiting[worker_id] = (dict(facts), [future])
        else:  # the same worker twice in one batch: one write with the later facts
            waiting[0].update(facts)
            waiting[1].append(future)
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # let the heartbeats already read in this turn join the first batch
        while self._waiting:
            batch = dict(list(self._waiting.items())[:MAX_BATCH])
            for worker_id in batch:
                del self._waiting[worker_id]
            try:
                missing = set(await self._store.heartbeat_many({w: facts for w, (facts, _) in batch.items()},
                                                               self._ttl_s))
            except Exception as exc:  # each caller sees the error its own heartbeat would have raised
                for _, futures in batch.values():
                    for future in futures:
                        if not future.done():
                            future.set_exception(exc)
                continue
            self.batches += 1
            for worker_id, (_, futures) in batch.items():
                for future in futures:
                    if not future.done():
                        future.set_result(worker_id not in missing)
