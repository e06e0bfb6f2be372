"""``FleetStore``: the one owner of the fleet in Redis. Every read and write of a fleet key, every script
and every change notification goes through it; the controller, the agent, extproc and ``poolgate status``
hold a store, never key names (those are ``poolgate.kernel.keys``).

Writes happen per worker and per heartbeat, never per request (extproc's in-flight counters are batched).
Registration and deregistration announce themselves on the events channel, heartbeats and live facts only
when asked (a change that moves picks), so a busy fleet does not flood it; expiries announce nothing, so
readers also re-read on a period.

Large fleets: every change a reader must see bumps the fleet version and names its worker in a change log
(``poolgate.kernel.store_scripts``), so readers keep their own map (``poolgate.kernel.fleet_view``) and
re-read only the workers named since their last read (``poll`` and ``read_workers``); identity and state
changes are logged apart from live facts, and a heartbeat that only says "alive" logs nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any

from redis.asyncio.client import PubSub
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import NoScriptError

from poolgate.kernel import store_scripts
from poolgate.kernel.fleet import WorkerRecord, WorkerState, encode_fields
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.outage import REDIS_ERRORS
from poolgate.kernel.redis_client import RedisLike, open_client

POOL_CONNECTIONS = 256
"""Redis connections one process opens at most (per node on Cluster); a caller past them waits for one
(``POOL_WAIT_S``)."""
POOL_WAIT_S = 10.0
"""How long a caller waits for a free connection before the call fails (as an outage does)."""


def connect(url: str, max_connections: int | None = POOL_CONNECTIONS, wait_s: float = POOL_WAIT_S, *,
            socket_timeout: float | None = None, socket_connect_timeout: float | None = None,
            retries: int | None = None) -> RedisLike:
    """The client every poolgate process opens, for any URL form ``poolgate.kernel.redis_client`` accepts
    (one server, Sentinel, Cluster). A burst of callers (192 registrations at once) queues for the pool's
    connections instead of failing at once with "too many connections"; ``max_connections=None`` opens as
    many as callers need (extproc, short-lived commands)."""
    return open_client(url, max_connections=max_connections, wait_s=wait_s, socket_timeout=socket_timeout,
                       socket_connect_timeout=socket_connect_timeout, retries=retries)


FACTS_PER_CALL = 500
"""Workers one ``WRITE_FACTS_MANY`` call writes at most (a larger batch is several calls in one pipeline), so
one call holds Redis for a few ms at most."""
PASSIVE_TTL_S = 60.0
"""A worker's data-path failure count expires this long after its last failure."""
QUEUED_TTL_S = 5.0
"""Expiry of a pool's ``queued`` hash, renewed on each write: a dead extproc replica's count fades after this."""

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


def _pairs(values: Mapping[str, Any]) -> list[str]:
    return [part for pair in encode_fields(values).items() for part in pair]


@dataclass(frozen=True, slots=True)
class FleetChange:
    """One change notification: ``kind`` is ``register``, ``update``, ``deregister`` or ``expire``;
    ``version`` is the fleet version the change wrote (0 from a writer that did not say)."""

    kind: str
    worker_id: str
    version: int = 0

    @classmethod
    def parse(cls, data: bytes | str) -> FleetChange:
        kind, _, rest = _text(data).partition(" ")
        worker_id, _, version = rest.partition(" ")
        return cls(kind, worker_id, int(version) if version.isdigit() else 0)


@dataclass(frozen=True, slots=True)
class ChangePoll:
    """What changed since a reader's version. ``changed`` and ``live`` are None when the reader must read
    the whole fleet again: its version is older than the trimmed log, or newer than Redis's (data lost)."""

    epoch: str
    version: int
    changed: frozenset[str] | None
    live: frozenset[str] | None
    records: Mapping[str, WorkerRecord | None] | None = None
    """The records of the ids in ``changed`` and ``live`` (None: not registered), read in the same step,
    when the poll was asked to read that many (``read_up_to``); else None."""
    held: int = 0
    """Workers past their heartbeat deadline that the mass-expiry guard keeps registered (``store_scripts.POLL``):
    so many overdue at once is the registry's trouble, not theirs. 0 in the usual case."""


class ChangeFeed:
    """The fleet's change notifications, subscribed while the ``async with`` block runs."""

    def __init__(self, redis: RedisLike, channel: str) -> None:
        self._redis = redis
        self._channel = channel
        self._pubsub: PubSub = redis.pubsub(ignore_subscribe_messages=True)

    async def __aenter__(self) -> ChangeFeed:
        if isinstance(self._redis, RedisCluster):
            # The subscription goes to the node the client maps the channel's slot to, without asking the
            # cluster: a keyed command first loads the map, and after a failover renews it (a dead master
            # fails the command and the client re-reads the topology), so the feed follows the new master.
            await self._redis.exists(self._channel)
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
        self._route = [self.keys.fleet_version]
        """The one key each fleet script names: Cluster sends the script to the master of the fleet's slot
        (the script builds its other key names from the tag, all in that slot)."""
        self._register = redis.register_script(store_scripts.REGISTER)
        self._write_facts = redis.register_script(store_scripts.WRITE_FACTS)
        self._write_facts_many = redis.register_script(store_scripts.WRITE_FACTS_MANY)
        self._add_inflight = redis.register_script(store_scripts.ADD_INFLIGHT)
        self._deregister = redis.register_script(store_scripts.DEREGISTER)
        self._poll = redis.register_script(store_scripts.POLL)
        self._expire_due = redis.register_script(store_scripts.EXPIRE_DUE)
        self._registry_serves = redis.register_script(store_scripts.REGISTRY_SERVES)

    def changes(self) -> ChangeFeed:
        """A subscription to change notifications: ``async with store.changes() as feed``."""
        return ChangeFeed(self._redis, self.keys.events)

    # Registration and liveness: the registrant's (registry API, local and Kubernetes backends).

    async def register(self, record: WorkerRecord, ttl_s: float) -> None:
        """Write a worker's full record, index it, and announce the change."""
        await self._register(client=self._redis, keys=self._route, args=self._register_args(record, ttl_s, "1"))

    async def register_many(self, records: Sequence[WorkerRecord], ttl_s: float) -> None:
        """``register`` for many workers in one pipeline and one announcement (a burst of registrations)."""
        if not records:
            return

        def queue(pipe: Any) -> None:
            for record in records:
                self._queue_script(pipe, self._register, self._register_args(record, ttl_s, "q"))
        await self._scripted_pipeline(queue, store_scripts.REGISTER)
        await self._redis.publish(self.keys.events, f"batch {len(records)}")  # a Cluster pipeline has no PUBLISH

    def _register_args(self, record: WorkerRecord, ttl_s: float, announce: str) -> list[Any]:
        """Registering is a liveness report: ``updated_at`` is stamped now, so a record built earlier (and
        re-sent after an expiry) is not stale."""
        now = time.time()
        record = replace(record, updated_at=now, registered_at=record.registered_at or now)
        return [self.keys.fleet, record.id, _ttl_ms(ttl_s), announce,
                *(p for pair in record.to_redis().items() for p in pair)]

    async def heartbeat(self, worker_id: str, ttl_s: float, announce: bool = False, **facts: Any) -> bool:
        """Refresh a worker's TTL and the given facts in one round trip; False means it is not registered
        (expired): register again. A changed ``state`` is announced; other facts only with ``announce``."""
        facts.setdefault("updated_at", time.time())
        return bool(await self._write_facts(client=self._redis, keys=self._route,
                                             args=self._facts_args(worker_id, _ttl_ms(ttl_s), announce, facts)))

    async def heartbeat_many(self, beats: Mapping[str, Mapping[str, Any]], ttl_s: float) -> list[str]:
        """Heartbeats of many workers (a node agent's, or the API's gathered ones) in one round trip; returns
        the ids not registered."""
        alive = await self._write_many(beats, _ttl_ms(ttl_s), "0", {"updated_at": time.time()})
        return [worker_id for worker_id, ok in zip(beats, alive, strict=True) if not ok]

    async def _write_many(self, facts: Mapping[str, Mapping[str, Any]], ttl_ms: int, announce: str,
                          common: Mapping[str, Any] | None = None) -> list[Any]:
        """``WRITE_FACTS`` for every worker in ``facts`` (each with ``common`` too, sent once per command): one
        command per ``FACTS_PER_CALL`` workers, all in one pipeline; ``WRITE_FACTS``'s answers in order."""
        if not facts:
            return []
        items = list(facts.items())
        shared = _pairs(common or {})

        def queue(pipe: Any) -> None:
            for start in range(0, len(items), FACTS_PER_CALL):
                args: list[Any] = [self.keys.fleet, ttl_ms, announce, len(shared), *shared]
                for worker_id, values in items[start:start + FACTS_PER_CALL]:
                    pairs = _pairs(values) if values else []
                    args += [worker_id, len(pairs), *pairs]
                self._queue_script(pipe, self._write_facts_many, args)
        return [answer for chunk in await self._scripted_pipeline(queue, store_scripts.WRITE_FACTS_MANY)
                for answer in chunk]

    def _facts_args(self, worker_id: str, ttl_ms: int, announce: bool | str, facts: Mapping[str, Any]) -> list[Any]:
        flag = announce if isinstance(announce, str) else int(announce)
        return [self.keys.fleet, worker_id, ttl_ms, flag, *_pairs(facts)]

    async def registry_serves(self, ttl_s: float) -> None:
        """A registry API process takes heartbeats now, and hands TTLs up to ``ttl_s``
        (``store_scripts.REGISTRY_ALIVE_S``): a worker overdue from now on went quiet itself."""
        await self._registry_serves(client=self._redis, keys=self._route, args=[self.keys.fleet, _ttl_ms(ttl_s)])

    async def deregister(self, worker_id: str) -> None:
        await self._deregister(client=self._redis, keys=self._route, args=[self.keys.fleet, worker_id])

    # Observed facts and states: the agent's and the health monitor's.

    async def update_live(self, worker_id: str, announce: bool = False, **live: Any) -> bool:
        """Write observed facts (the agent's) without touching the TTL: liveness stays the registrant's job,
        so a worker whose heartbeats stop still leaves even while its /metrics answers. False = not
        registered."""
        return bool(await self._write_facts(client=self._redis, keys=self._route,
                                             args=self._facts_args(worker_id, 0, announce, live)))

    async def set_state(self, worker_id: str, state: WorkerState) -> bool:
        """Change a registered worker's state and announce it; False when it is not registered."""
        return await self.update_live(worker_id, announce=True, state=state.value)

    async def set_states(self, states: Mapping[str, WorkerState]) -> list[str]:
        """Many state changes in one pipeline, then one announcement (the health monitor's round); returns
        the ids written. Each change is logged, so readers take the whole batch in one read."""
        if not states:
            return []

        written = await self._write_many({worker_id: {"state": state.value} for worker_id, state in states.items()},
                                         0, "q")
        await self._redis.publish(self.keys.events, f"batch {len(states)}")  # a Cluster pipeline has no PUBLISH
        return [worker_id for worker_id, ok in zip(states, written, strict=True) if ok]

    def _queue_script(self, pipe: Any, script: Any, args: list[Any]) -> None:
        """A script by its digest on a pipeline (a Cluster pipeline has no ``evalsha`` method)."""
        pipe.execute_command("EVALSHA", script.sha, len(self._route), *self._route, *args)

    async def _scripted_pipeline(self, queue: Callable[[Any], None], script: str) -> list[Any]:
        """Run the calls of ``script`` that ``queue`` puts on one pipeline. A server that does not know the
        script (restarted, or a replica a failover promoted) answers NOSCRIPT: load it and send the
        pipeline again (its writes bear repeating)."""
        pipe = self._redis.pipeline(transaction=False)
        queue(pipe)
        try:
            return list(await pipe.execute())
        except NoScriptError:
            await self._redis.script_load(script)
        pipe = self._redis.pipeline(transaction=False)
        queue(pipe)
        return list(await pipe.execute())

    # Reads.

    async def read_fleet(self) -> list[WorkerRecord]:
        """All registered workers, sorted by id, once the overdue ones have expired (as ``poll`` expires them).
        Ids whose hash expired are pruned from the index."""
        await self._expire_due(client=self._redis, keys=self._route, args=[self.keys.fleet])
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
                pipe.hdel(self.keys.inflight, worker_id)
            await pipe.execute()
        return [WorkerRecord.from_redis(data) for data in raw if data]

    async def exchange(self, queue: Callable[[Any], Callable[[list[Any]], None]]) -> None:
        """Run the commands ``queue`` puts on one pipeline and hand their results to the callback it returns:
        the read side of extproc's peer exchange, whose keys ``RedisKeys.peers`` names."""
        pipe = self._redis.pipeline(transaction=False)
        apply = queue(pipe)
        apply(await pipe.execute())

    async def poll(self, since: int, live: bool = True, limit: int = 5000, read_up_to: int = 0) -> ChangePoll:
        """Ids changed since version ``since`` (expiring the overdue workers first); see ``ChangePoll``.
        More than ``limit`` changes in one log also means: read everything. When ``read_up_to`` or fewer
        changed, their records come with the answer (``ChangePoll.records``): one round trip, not two."""
        epoch, version, _, changed, changed_live, read, held = await self._poll(
            client=self._redis, keys=self._route, args=[self.keys.fleet, since, int(live), limit, read_up_to])

        def ids(values: list[bytes] | None) -> frozenset[str] | None:
            return None if values is None or len(values) >= limit else frozenset(_text(v) for v in values)

        records = None if not read else {
            _text(worker_id): WorkerRecord.from_redis(dict(zip(fields[::2], fields[1::2], strict=True))) if fields
            else None for worker_id, fields in zip(read[::2], read[1::2], strict=True)}
        return ChangePoll(_text(epoch), int(version), ids(changed), ids(changed_live) if live else frozenset(),
                          records, int(held))

    async def count_workers(self) -> int:
        """Workers registered (the index's size: one command, whatever the fleet's size). An expired worker
        counts until a reader prunes it, within a poll period."""
        return int(await self._redis.scard(self.keys.workers))

    async def read_workers(self, worker_ids: Sequence[str]) -> dict[str, WorkerRecord | None]:
        """The records of these workers (None for one that is not registered), in one pipeline."""
        if not worker_ids:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in worker_ids:
            pipe.hgetall(self.keys.worker(worker_id))
        raw = await pipe.execute()
        return {w: WorkerRecord.from_redis(data) if data else None for w, data in zip(worker_ids, raw, strict=True)}

    async def read_inflight(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """Requests extproc replicas have in flight per worker (0 when none)."""
        if not worker_ids:
            return {}
        values = await self._redis.hmget(self.keys.inflight, list(worker_ids))
        return {w: max(0, int(v or 0)) for w, v in zip(worker_ids, values, strict=True)}

    async def read_busy(self) -> dict[str, int]:
        """Requests in flight on every worker that has any (one read, as large as the busy part of the fleet)."""
        return {_text(w): n for w, v in (await self._redis.hgetall(self.keys.inflight)).items() if (n := int(v)) > 0}

    async def read_passive_failures(self, prune_to: Collection[str] | None = None) -> dict[str, int]:
        """Cumulative data-path failure counts of the workers that have any (readers compare with their last
        read). With ``prune_to`` (the workers the reader knows), the fields of every other worker are removed."""
        counts = {_text(w): max(0, int(v)) for w, v in (await self._redis.hgetall(self.keys.passive)).items()}
        if prune_to is not None:
            gone = [worker_id for worker_id in counts if worker_id not in prune_to]
            if gone:
                await self._redis.hdel(self.keys.passive, *gone)
                for worker_id in gone:
                    del counts[worker_id]
        return counts

    async def read_queued(self, pool: str) -> int:
        """Requests extproc replicas hold for a pool (the sum of their fields; 0 when none report)."""
        return sum(max(0, int(v)) for v in await self._redis.hvals(self.keys.queued(pool)))

    # The data path's counters (extproc and any other data-path process).

    async def record_passive_failures(self, counts: Mapping[str, int]) -> None:
        """Data-path failures per worker (5xx answered by it, upstream timeouts, resets), in one pipeline."""
        if not counts:
            return
        pipe = self._redis.pipeline(transaction=False)
        for worker_id, count in counts.items():
            pipe.hincrby(self.keys.passive, worker_id, count)
        pipe.pexpire(self.keys.passive, _ttl_ms(PASSIVE_TTL_S))
        await pipe.execute()

    async def add_counts(self, inflight_deltas: Mapping[str, int], queued: Mapping[str, int],
                         replica_id: str, also: Callable[[Any], object] | None = None) -> None:
        """One pipeline: add in-flight deltas per worker, and set this replica's held count per pool (0 removes
        its field); ``also`` queues more writes of the same flush on it (extproc's peer exchange: absolute
        values, which bear repeating when a restarted server asks for the script and the pipeline goes again)."""
        deltas = [part for worker_id, delta in inflight_deltas.items() if delta for part in (worker_id, delta)]

        def queue(pipe: Any) -> None:
            if also is not None:
                also(pipe)
            if deltas:
                pipe.execute_command("EVALSHA", self._add_inflight.sha, 1, self.keys.inflight, *deltas)
            for pool, count in queued.items():
                key = self.keys.queued(pool)
                if count:
                    pipe.hset(key, replica_id, count)
                    pipe.pexpire(key, _ttl_ms(QUEUED_TTL_S))
                else:
                    pipe.hdel(key, replica_id)
        await self._scripted_pipeline(queue, store_scripts.ADD_INFLIGHT)

    # The controllers' lease and the leader's address.

    async def take_lease(self, holder: str, ttl_s: float) -> bool:
        """Take the free leader lease or extend our own for ``ttl_s``; False when another holder has it."""
        return bool(await self._redis.eval(_TAKE_LEASE, 1, self.keys.leader, holder, str(_ttl_ms(ttl_s))))

    async def release_lease(self, holder: str) -> None:
        """Give the lease up, if ``holder`` still has it."""
        await self._redis.eval(_RELEASE_LEASE, 1, self.keys.leader, holder)

    # Drains in progress: the leader's, kept where its successor finds them.

    async def record_drain(self, worker_id: str, end: str, started_at: float) -> None:
        await self._redis.hset(self.keys.drains, worker_id, f"{end} {started_at!r}")

    async def forget_drain(self, worker_id: str) -> None:
        await self._redis.hdel(self.keys.drains, worker_id)

    async def read_drains(self) -> dict[str, tuple[str, float]]:
        """Worker id → (how the drain ends, epoch seconds it began), for every drain not finished."""
        drains: dict[str, tuple[str, float]] = {}
        for worker_id, value in (await self._redis.hgetall(self.keys.drains)).items():
            end, _, started = _text(value).partition(" ")
            drains[_text(worker_id)] = (end, float(started or 0.0))
        return drains

    async def announce_controller(self, api_url: str) -> None:
        await self._redis.set(self.keys.controller, api_url)

    async def controller_url(self) -> str | None:
        """The API base URL the leading controller announced, or None."""
        url = await self._redis.get(self.keys.controller)
        return _text(url) if url else None
