"""Gathers the registry API's writes into one Redis pipeline per batch: heartbeats (single ones and nodes'
batches alike), and registrations.

At 1,000 workers beating every 0.5 s the API takes 2,000 heartbeats a second, and a fleet that starts (or
a controller that restarts) sends thousands of registrations at once. Sent one by one, each write pays
redis-py's whole per-command path (pool checkout, retry wrapper, timeouts, its own round trip) and each
registration wakes every reader with its own announcement; gathered, the writes that arrive while one
batch is in Redis leave together in the next, one pipeline and (for registrations) one announcement. Under
light load a batch holds one write and costs what a single one did; under heavy load batches grow and the
cost per write falls, instead of queueing until workers expire and register again (which is how a loaded
registry used to collapse: late heartbeats, expiries, re-registrations, more load).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, TypeVar

from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore

MAX_BATCH = 2000
"""Writes per pipeline at most (a larger backlog goes in the next)."""
ROUTINE_GATHER_S = 0.01
"""A routine heartbeat (no state) waits this long for others before its batch leaves. Heartbeats arrive one by
one (each worker on its own connection, at its own phase), so a batch of "the writes read in this turn" held one
heartbeat nearly always, and each paid a whole pipeline: ~300 µs of an API process's CPU per heartbeat at 900 a
second, most of it redis-py's per-pipeline path. Gathered for 10 ms, a batch holds ~9 at that rate. It costs a
routine heartbeat 10 ms of its answer, against a TTL of seconds; a state change never waits for it."""

V = TypeVar("V")
R = TypeVar("R")


class _Waiter(Generic[R]):
    """One caller's writes: answered once every one of its keys has been through a batch."""

    __slots__ = ("answers", "future", "pending")

    def __init__(self, future: asyncio.Future[dict[str, R]], pending: int) -> None:
        self.future = future
        self.pending = pending
        self.answers: dict[str, R] = {}


class Coalescer(Generic[V, R]):
    """``submit(key, value)`` answers ``flush``'s result for that key; ``submit_many`` does so for many keys
    at once (a node's heartbeats), with one wait. A key submitted twice before its batch leaves is written
    once, with ``merge(earlier, later)``, and both callers get its answer. A batch leaves ``gather_s`` after the
    first write of it came (0: once the writes read in the same turn of the loop have joined it), and the writes
    that came while it was in Redis ``gather_s`` after it (at once with 0, or once they fill a batch)."""

    def __init__(self, flush: Callable[[dict[str, V]], Awaitable[Mapping[str, R]]],
                 merge: Callable[[V, V], V], gather_s: float = 0.0) -> None:
        self._flush_batch = flush
        self._merge = merge
        self._gather_s = gather_s
        self._waiting: dict[str, tuple[V, list[_Waiter[R]]]] = {}
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0
        """Pipelines sent so far (for tests and the benchmark)."""

    async def submit(self, key: str, value: V) -> R:
        return (await self.submit_many({key: value}))[key]

    async def submit_many(self, values: Mapping[str, V]) -> dict[str, R]:
        if not values:
            return {}
        waiter: _Waiter[R] = _Waiter(asyncio.get_running_loop().create_future(), len(values))
        for key, value in values.items():
            waiting = self._waiting.get(key)
            if waiting is None:
                self._waiting[key] = (value, [waiter])
            else:
                waiting[1].append(waiter)
                self._waiting[key] = (self._merge(waiting[0], value), waiting[1])
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await waiter.future

    async def _flush(self) -> None:
        await asyncio.sleep(self._gather_s)  # let the writes of this turn (or of the gathering time) join
        while self._waiting:
            batch = dict(list(self._waiting.items())[:MAX_BATCH])
            for key in batch:
                del self._waiting[key]
            try:
                answers = await self._flush_batch({key: value for key, (value, _) in batch.items()})
            except Exception as exc:  # each caller sees the error its own write would have raised
                for _, waiters in batch.values():
                    for waiter in waiters:
                        if not waiter.future.done():
                            waiter.future.set_exception(exc)
                continue
            self.batches += 1
            for key, (_, waiters) in batch.items():
                for waiter in waiters:
                    waiter.answers[key] = answers[key]
                    waiter.pending -= 1
                    if not waiter.pending and not waiter.future.done():
                        waiter.future.set_result(waiter.answers)
            if self._gather_s and self._waiting and len(self._waiting) < MAX_BATCH:
                await asyncio.sleep(self._gather_s)  # what came while it was in Redis gathers company too


class HeartbeatCoalescer:
    """``beat`` answers whether the worker is registered, as ``FleetStore.heartbeat`` does. Heartbeats that
    report a state are written at once by their own call, beside the routine batches: a state change (a worker
    turning Draining) is one of the few writes another part waits for. In the routine lane it waited for the
    batch in flight and then went with the next (at 10,000 workers a routine batch took 15 ms at p90 and 63 ms
    at p99 on a busy host); in a lane of its own it still waited two turns of a busy loop (its flushing task's
    start, and the turn a batch waits for company). Nothing in a routine heartbeat can undo what a state
    heartbeat wrote: it carries no state. Each heartbeat carries the TTL its answer names (the registry stretches
    it with the fleet: ``controller.heartbeat_interval``); a batch writes each TTL of its heartbeats in a pipeline
    of its own, at once (a few: TTLs are rounded to a step), and a worker beaten twice in one batch keeps the
    longer. Routine heartbeats are gathered for ``gather_s`` before their batch leaves (``ROUTINE_GATHER_S``)."""

    def __init__(self, store: FleetStore, gather_s: float = ROUTINE_GATHER_S) -> None:
        async def flush(beats: dict[str, tuple[dict[str, Any], float]]) -> dict[str, bool]:
            by_ttl: dict[float, dict[str, dict[str, Any]]] = {}
            for worker_id, (facts, ttl_s) in beats.items():
                by_ttl.setdefault(ttl_s, {})[worker_id] = facts
            answers = await asyncio.gather(*(store.heartbeat_many(group, ttl_s) for ttl_s, group in by_ttl.items()))
            missing = {worker_id for not_registered in answers for worker_id in not_registered}
            return {worker_id: worker_id not in missing for worker_id in beats}

        def merge(earlier: tuple[dict[str, Any], float], later: tuple[dict[str, Any], float]
                  ) -> tuple[dict[str, Any], float]:
            return {**earlier[0], **later[0]}, max(earlier[1], later[1])

        self._store = store
        self._routine: Coalescer[tuple[dict[str, Any], float], bool] = Coalescer(flush, merge, gather_s)

    @property
    def batches(self) -> int:
        """Routine pipelines sent so far (for tests and the benchmark)."""
        return self._routine.batches

    async def beat(self, worker_id: str, facts: Mapping[str, Any], ttl_s: float) -> bool:
        if "state" in facts:
            return not await self._store.heartbeat_many({worker_id: dict(facts)}, ttl_s)
        return await self._routine.submit(worker_id, (dict(facts), ttl_s))

    async def beat_many(self, beats: Mapping[str, dict[str, Any]], ttl_s: float) -> list[str]:
        """A node's heartbeats, the routine ones written with every other of the same turn; the ids not
        registered."""
        with_state = {worker_id: facts for worker_id, facts in beats.items() if "state" in facts}
        routine = {worker_id: (facts, ttl_s) for worker_id, facts in beats.items() if "state" not in facts}
        if not with_state:
            answers = await self._routine.submit_many(routine)
            return [worker_id for worker_id in beats if not answers[worker_id]]
        if not routine:
            return await self._store.heartbeat_many(with_state, ttl_s)
        missing, answers = await asyncio.gather(self._store.heartbeat_many(with_state, ttl_s),
                                                self._routine.submit_many(routine))
        return [worker_id for worker_id in beats if worker_id in missing or not answers.get(worker_id, True)]


class RegistrationCoalescer(Coalescer[WorkerRecord, None]):
    """``register`` returns once the record is written; the same worker twice in one batch: the later record."""

    def __init__(self, store: FleetStore, ttl_s: Callable[[], float]) -> None:
        async def flush(records: dict[str, WorkerRecord]) -> dict[str, None]:
            await store.register_many(list(records.values()), ttl_s())
            return dict.fromkeys(records)

        super().__init__(flush, lambda earlier, later: later)

    async def register(self, record: WorkerRecord) -> None:
        await self.submit(record.id, record)
