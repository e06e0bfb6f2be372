"""``FleetStore``: the one owner of the fleet in Redis. Every read and write of a fleet key, every script
and every change notification goes through it; the controller, the agent, extproc and ``poolgate status``
hold a store, never key names (those are ``poolgate.kernel.keys``).

Writes happen per worker and per heartbeat, never per request (extproc's in-flight counters are batched).
Registration and deregistration announce themselves on the events channel, heartbeats and live facts only
when asked (a change that moves picks), so a busy fleet does not flood it; expiries announce nothing, so
readers also re-read on a period.

Room to grow (large fleets): today every reader re-reads the whole fleet on any change. The seams for
incremental reads are here: a change message already names its worker (``FleetChange``), the schema
already tells live facts from identity (``LIVE_FIELDS``), and no caller knows how a record is laid out in
Redis. A version per change, live facts in a hash of their own and a ``read_workers(ids)`` would let a
reader keep its own map and re-read only the workers named since its last read.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, TypeAlias

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from poolgate.kernel.fleet import WorkerRecord, WorkerState, encode_fields
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.outage import REDIS_ERRORS

RedisLike: TypeAlias = Redis
"""The async client every poolgate process uses (works with redis://, rediss://, unix:// URLs)."""

PASSIVE_TTL_S = 60.0
"""A worker's data-path failure count expires this long after its last failure."""
QUEUED_TTL_S = 5.0
"""Expiry of a pool's ``queued`` hash, renewed on each write: a dead extproc replica's count fades after this."""

# HSET only while the worker is registered: never creates a record, never extends its life.
_UPDATE_IF_REGISTERED = """
if redis.call('exists', KEYS[1]) == 0 then return 0 end
redis.call('hset', KEYS[1], unpack(ARGV))
return 1
"""

_TAKE_LEASE = """
local holder = redis.call('get', KEYS[1])
if holder == ARGV[1] then
  redis.call('pexpire', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""

_RELEASE_LEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


def _ttl_ms(ttl_s: float) -> int:
    return max(1, int(ttl_s * 1000))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class FleetChange:
    """One change notification: ``kind`` is ``register``, ``update`` or ``deregister``."""

    kind: str
    worker_id: str

    @classmethod
    def parse(cls, data: bytes | str) -> FleetChange:
        kind, _, worker_id = _text(data).partition(" ")
        return cls(kind, worker_id)


class ChangeFeed:
    """The fleet's change notifications, subscribed while the ``async with`` block runs."""

    def __init__(self, redis: RedisLike, channel: str) -> None:
        self._channel = channel
        self._pubsub: PubSub = redis.pubsub(ignore_subscribe_messages=True)

    async def __aenter__(self) -> ChangeFeed:
        await self._pubsub.subscribe(self._channel)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        with contextlib.suppress(*REDIS_ERRORS):
            await self._pubsub.aclose()

    async def changes(self, timeout_s: float) -> list[FleetChange]:
        """Wait up to ``timeout_s`` for a change, then take every change already queued behind it."""
        changes: list[FleetChange] = []
        message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=timeout_s)
        while message is not None:
            changes.append(FleetChange.parse(message["data"]))
            message = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
        return changes


class FleetStore:
    """The fleet in one Redis under one key prefix. Redis errors propagate: each caller decides what an
    outage means for it (``poolgate.kernel.outage``)."""

    def __init__(self, redis: RedisLike, prefix: str = "poolgate") -> None:
        self._redis = redis
        self.keys = RedisKeys(prefix)

    def changes(self) -> ChangeFeed:
        """A subscription to change notifications: ``async with store.changes() as feed``."""
        return ChangeFeed(self._redis, self.keys.events)

    # Registration and liveness: the registrant's (registry API, local and Kubernetes backends).

    async def register(self, record: WorkerRecord, ttl_s: float) -> None:
        """Write a worker's full record, index it, and announce the change. Registering is a liveness report:
        ``updated_at`` is stamped now, so a record built earlier (and re-sent after an expiry) is not stale."""
        now = time.time()
        record = replace(record, updated_at=now, registered_at=record.registered_at or now)
        name = self.keys.worker(record.id)
        pipe = self._redis.pipeline(transaction=False)
        pipe.delete(name)
        pipe.hset(name, mapping=dict[Any, Any](record.to_redis()))
        pipe.pexpire(name, _ttl_ms(ttl_s))
        pipe.sadd(self.keys.workers, record.id)
        pipe.publish(self.keys.events, f"register {record.id}")
        await pipe.execute()

    async def heartbeat(self, worker_id: str, ttl_s: float, announce: bool = False, **facts: Any) -> bool:
        """Refresh a worker's TTL and the given facts; False means it is not registered (expired): register
        again."""
        name = self.keys.worker(worker_id)
        facts.setdefault("updated_at", time.time())
        pipe = self._redis.pipeline(transaction=False)
        pipe.exists(name)
        pipe.pexpire(name, _ttl_ms(ttl_s))
        exists, _ = await pipe.execute()
        if not exists:
            return False
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(name, mapping=dict[Any, Any](encode_fields(facts)))
        pipe.pexpire(name, _ttl_ms(ttl_s))
        if announce:
            pipe.publish(self.keys.events, f"update {worker_id}")
        await pipe.execute()
        return True

    async def deregister(self, worker_id: str) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(worker_id))
        pipe.delete(self.keys.inflight(worker_id))
        pipe.delete(self.keys.passive(worker_id))
        pipe.srem(self.keys.workers, worker_id)
        pipe.publish(self.keys.events, f"deregister {worker_id}")
        await pipe.execute()

    # Observed facts and states: the agent's and the health monitor's.

    async def update_live(self, worker_id: str, announce: bool = False, **live: Any) -> bool:
        """Write observed facts (the agent's) without touching the TTL: liveness stays the registrant's job,
        so a worker whose heartbeats stop still leaves even while its /metrics answers. False = not
        registered."""
        args = [part for pair in encode_fields(live).items() for part in pair]
        written = await self._redis.eval(_UPDATE_IF_REGISTERED, 1, self.keys.worker(worker_id), *args)
        if written and announce:
            await self._redis.publish(self.keys.events, f"update {worker_id}")
        return bool(written)

    async def set_state(self, worker_id: str, state: WorkerState) -> bool:
        """Change a registered worker's state and announce it; False when it is not registered."""
        return await self.update_live(worker_id, announce=True, state=state.value)

    # Reads.

    async def read_fleet(self) -> list[WorkerRecord]:
        """All registered workers, sorted by id. Ids whose hash expired are pruned from the index."""
        ids = sorted(_text(i) for i in await self._redis.smembers(self.keys.workers))
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self.keys.worker(worker_id))
        raw = await pipe.execute()
        expired = [worker_id for worker_id, data in zip(ids, raw, strict=True) if not data]
        if expired:
            pipe = self._redis.pipeline(transaction=False)
            for worker_id in expired:
                pipe.srem(self.keys.workers, worker_id)
                pipe.delete(self.keys.inflight(worker_id))
            await pipe.execute()
        return [WorkerRecord.from_redis(data) for data in raw if data]

    async def exchange(self, queue: Callable[[Any], Callable[[list[Any]], None]]) -> None:
        """Run the commands ``queue`` puts on one pipeline and hand their results to the callback it returns:
        the read side of extproc's peer exchange, whose keys ``RedisKeys.peers`` names."""
        pipe = self._redis.pipeline(transaction=False)
        apply = queue(pipe)
        apply(await pipe.execute())

    async def read_inflight(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Requests extproc replicas have in flight per worker (0 when none)."""
        return await self._counts([self.keys.inflight(w) for w in worker_ids], worker_ids)

    async def read_passive_failures(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Cumulative data-path failure counts (0 when none or expired); readers compare with their last read."""
        return await self._counts([self.keys.passive(w) for w in worker_ids], worker_ids)

    async def _counts(self, keys: list[str], worker_ids: Sequence[str]) -> dict[str, int]:
        if not keys:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        values = await pipe.execute()
        return {w: max(0, int(v or 0)) for w, v in zip(worker_ids, values, strict=True)}

    async def read_queued(self, pool: str) -> int:
        """Requests extproc replicas hold for a pool (the sum of their fields; 0 when none report)."""
        return sum(max(0, int(v)) for v in await self._redis.hvals(self.keys.queued(pool)))

    # The data path's counters (extproc and any other data-path process).

    async def record_passive_failure(self, worker_id: str, count: int = 1) -> None:
        """A data-path failure on a worker (5xx answered by it, upstream timeout, reset before headers)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.incrby(self.keys.passive(worker_id), count)
        pipe.pexpire(self.keys.passive(worker_id), _ttl_ms(PASSIVE_TTL_S))
        await pipe.execute()

    async def add_counts(self, inflight_deltas: Mapping[str, int], queued: Mapping[str, int],
                         replica_id: str, also: Callable[[Any], object] | None = None) -> None:
        """One pipeline: add in-flight deltas per worker, and set this replica's held count per pool (0 removes
        its field); ``also`` queues more writes of the same flush on it (extproc's peer exchange)."""
        pipe = self._redis.pipeline(transaction=False)
        if also is not None:
            also(pipe)
        for worker_id, delta in inflight_deltas.items():
            pipe.incrby(self.keys.inflight(worker_id), delta)
        for pool, count in queued.items():
            key = self.keys.queued(pool)
            if count:
                pipe.hset(key, replica_id, count)
                pipe.pexpire(key, _ttl_ms(QUEUED_TTL_S))
            else:
                pipe.hdel(key, replica_id)
        await pipe.execute()

    # The controllers' lease and the leader's address.

    async def take_lease(self, holder: str, ttl_s: float) -> bool:
        """Take the free leader lease or extend our own for ``ttl_s``; False when another holder has it."""
        return bool(await self._redis.eval(_TAKE_LEASE, 1, self.keys.leader, holder, str(_ttl_ms(ttl_s))))

    async def release_lease(self, holder: str) -> None:
        """Give the lease up, if ``holder`` still has it."""
        await self._redis.eval(_RELEASE_LEASE, 1, self.keys.leader, holder)

    async def announce_controller(self, api_url: str) -> None:
        await self._redis.set(self.keys.controller, api_url)

    async def controller_url(self) -> str | None:
        """The API base URL the leading controller announced, or None."""
        url = await self._redis.get(self.keys.controller)
        return _text(url) if url else None
