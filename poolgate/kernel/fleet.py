"""Fleet state in Redis: the one schema that the controller, the agent and extproc share.

Layout under one key prefix (every key is single-key or within one hash slot, so Redis Cluster works):

- ``{prefix}:worker:{id}``  hash of static facts (pool, model, address, node, limits) and live facts (state,
  KV usage, queue, updated_at). It expires when heartbeats stop.
- ``{prefix}:workers``      set of worker ids (an index; readers prune ids whose hash has expired).
- ``{prefix}:inflight:{id}`` cross-replica count of requests extproc has in flight on a worker.
- ``{prefix}:events``       pub/sub channel; any message means "the fleet changed, refresh now".
- ``{prefix}:passive:{id}`` count of data-path failures (5xx, timeouts, resets before headers) seen on a
  worker; any data-path process ``INCR``s it (``record_passive_failure``); the controller's health monitor
  reads the growth per probe interval. It expires a minute after the last failure.
- ``{prefix}:queued:{pool}`` hash: requests each extproc replica holds in its queue for a pool (``HSET``
  field = replica id, value = its current count, with ``PEXPIRE`` of a few seconds on every write so a
  dead replica's count fades); the autoscaler reads the sum as queue pressure.
- ``{prefix}:leader``       the controller leader lease (holder id, ``SET NX PX``).
- ``{prefix}:controller``   the leader controller's API base URL, for operator commands.

Writes happen per worker and per heartbeat, never per request (except the in-flight counters).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields, replace
from enum import StrEnum
from typing import Any, TypeAlias

import orjson
from redis.asyncio import Redis


class WorkerState(StrEnum):
    STARTING = "Starting"
    READY = "Ready"
    BUSY = "Busy"
    DRAINING = "Draining"
    FAILED = "Failed"


@dataclass(frozen=True)
class WorkerRecord:
    """What the fleet knows about one worker. Static facts come at registration, live ones with heartbeats."""

    id: str
    pool: str
    model: str
    host: str
    port: int
    served_names: tuple[str, ...] = ()
    max_model_len: int = 8192
    backend: str = "sim"
    node: str = ""
    """The node (machine) the worker runs on, for the agent of that node; "" = not known (registered by an
    older writer, or by a registrant that did not say). On Kubernetes: the pod's ``spec.nodeName``."""
    state: WorkerState = WorkerState.READY
    kv_capacity_tokens: int = 0
    """KV cache size in tokens (num_gpu_blocks × block_size); 0 = not reported yet."""
    kv_block_size: int = 16
    kv_usage: float = 0.0
    """Fraction of KV blocks in use, 0..1 (vllm:kv_cache_usage_perc)."""
    running: int = 0
    waiting: int = 0
    preemptions_total: int = 0
    ttft_ewma_s: float = -1.0
    """Recent time to first token (moving average of the worker's histogram deltas); -1 = unknown."""
    prefill_tokens_per_s: float = 0.0
    """Observed prompt throughput while busy; 0 = unknown (the scheduler then uses its configured default)."""
    gpu_memory_total_mib: float = -1.0
    gpu_memory_free_mib: float = -1.0
    gpu_utilization: float = -1.0
    """0..1 across the worker's GPUs; -1 = unknown (no NVML and no simulated GPU)."""
    updated_at: float = field(default_factory=time.time)
    """Last liveness report (registration or heartbeat)."""
    metrics_at: float = 0.0
    """When the agent last read this worker's metrics and GPUs; 0 = never. Live facts older than the
    staleness bound must not be trusted for placement even while the worker still heartbeats."""
    registered_at: float = 0.0
    """When this registration was written (set by ``register_worker``): tells a restarted worker from the
    same worker seen again."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters with requests running or waiting on the worker (``vllm:lora_requests_info``)."""
    max_loras: int = 0
    """Adapters the worker can hold at once (``max_lora`` label); 0 = LoRA not enabled or not reported."""
    kv_events_endpoint: str = ""
    """Where the engine publishes its KV-cache events (vLLM's ``--kv-events-config`` endpoint, as a subscriber
    connects to it, e.g. ``tcp://10.0.0.5:5557``); "" = it publishes none, and the router estimates."""
    kv_events_replay_endpoint: str = ""
    """Its replay socket (``replay_endpoint``), for catching up after a gap; "" = none."""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_names or (self.model,)

    def to_redis(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for key, value in asdict(self).items():
            if isinstance(value, tuple | list):
                out[key] = orjson.dumps(list(value)).decode()
            else:
                out[key] = str(value)
        return out

    @classmethod
    def from_redis(cls, raw: dict[bytes, bytes] | dict[str, str]) -> WorkerRecord:
        data = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
                for k, v in raw.items()}
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            text = data[f.name]
            if f.name in ("served_names", "lora_adapters"):
                kwargs[f.name] = tuple(orjson.loads(text))
            elif f.name == "state":
                kwargs[f.name] = WorkerState(text)
            elif f.type in ("int",):
                kwargs[f.name] = int(float(text))
            elif f.type in ("float",):
                kwargs[f.name] = float(text)
            else:
                kwargs[f.name] = text
        return cls(**kwargs)

    def with_live(self, **live: Any) -> WorkerRecord:
        return replace(self, **live)


LIVE_FIELDS = ("state", "kv_capacity_tokens", "kv_block_size", "kv_usage", "running", "waiting",
               "preemptions_total", "ttft_ewma_s", "prefill_tokens_per_s", "gpu_memory_total_mib",
               "gpu_memory_free_mib", "gpu_utilization", "updated_at", "metrics_at", "lora_adapters", "max_loras")


class FleetKeys:
    """Key names under one prefix."""

    def __init__(self, prefix: str = "poolgate") -> None:
        self.prefix = prefix
        self.workers = f"{prefix}:workers"
        self.events = f"{prefix}:events"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def inflight(self, worker_id: str) -> str:
        return f"{self.prefix}:inflight:{worker_id}"

    def passive(self, worker_id: str) -> str:
        return f"{self.prefix}:passive:{worker_id}"

    def queued(self, pool: str) -> str:
        return f"{self.prefix}:queued:{pool}"

    @property
    def leader(self) -> str:
        return f"{self.prefix}:leader"

    @property
    def controller(self) -> str:
        return f"{self.prefix}:controller"


RedisLike: TypeAlias = Redis
"""The async client every poolgate process uses (works with redis://, rediss://, unix:// URLs)."""


def _ttl_ms(ttl_s: float) -> int:
    return max(1, int(ttl_s * 1000))


async def register_worker(redis: RedisLike, keys: FleetKeys, record: WorkerRecord, ttl_s: float) -> None:
    """Write a worker's full record, index it, and announce the change. Registering is a liveness report:
    ``updated_at`` is stamped now, so a record built earlier (and re-sent after an expiry) is not stale."""
    record = replace(record, updated_at=time.time())
    pipe = redis.pipeline(transaction=False)
    name = keys.worker(record.id)
    if not record.registered_at:
        record = replace(record, registered_at=time.time())
    pipe.delete(name)
    pipe.hset(name, mapping=dict[Any, Any](record.to_redis()))
    pipe.pexpire(name, _ttl_ms(ttl_s))
    pipe.sadd(keys.workers, record.id)
    pipe.publish(keys.events, f"register {record.id}")
    await pipe.execute()


async def heartbeat_worker(
    redis: RedisLike, keys: FleetKeys, worker_id: str, ttl_s: float, announce: bool = False, **live: Any
) -> bool:
    """Refresh a worker's TTL and live facts; False means it is not registered (expired): re-register."""
    name = keys.worker(worker_id)
    live.setdefault("updated_at", time.time())
    mapping: dict[Any, Any] = {k: str(v) for k, v in live.items()}
    pipe = redis.pipeline(transaction=False)
    pipe.exists(name)
    pipe.pexpire(name, _ttl_ms(ttl_s))
    results = await pipe.execute()
    if not results[0]:
        return False
    pipe = redis.pipeline(transaction=False)
    pipe.hset(name, mapping=mapping)
    pipe.pexpire(name, _ttl_ms(ttl_s))
    if announce:
        pipe.publish(keys.events, f"update {worker_id}")
    await pipe.execute()
    return True


# HSET only while the worker is registered: never creates a record, never extends its life.
_UPDATE_IF_REGISTERED = """
if redis.call('exists', KEYS[1]) == 0 then return 0 end
redis.call('hset', KEYS[1], unpack(ARGV))
return 1
"""


async def update_live_facts(redis: RedisLike, keys: FleetKeys, worker_id: str, announce: bool = False,
                            **live: Any) -> bool:
    """Write observed facts (the agent's) without touching the TTL: liveness stays the registrant's job,
    so a worker whose heartbeats stop still leaves even while its /metrics answers. False = not registered."""
    args: list[str] = []
    for key, value in live.items():
        args += [key, str(value)]
    written = await redis.eval(_UPDATE_IF_REGISTERED, 1, keys.worker(worker_id), *args)
    if written and announce:
        await redis.publish(keys.events, f"update {worker_id}")
    return bool(written)


async def deregister_worker(redis: RedisLike, keys: FleetKeys, worker_id: str) -> None:
    pipe = redis.pipeline(transaction=False)
    pipe.delete(keys.worker(worker_id))
    pipe.delete(keys.inflight(worker_id))
    pipe.delete(keys.passive(worker_id))
    pipe.srem(keys.workers, worker_id)
    pipe.publish(keys.events, f"deregister {worker_id}")
    await pipe.execute()


async def read_fleet(redis: RedisLike, keys: FleetKeys) -> list[WorkerRecord]:
    """All registered workers, sorted by id. Ids whose hash expired are pruned from the index."""
    ids = sorted(i.decode() if isinstance(i, bytes) else i for i in await redis.smembers(keys.workers))
    if not ids:
        return []
    pipe = redis.pipeline(transaction=False)
    for worker_id in ids:
        pipe.hgetall(keys.worker(worker_id))
    raw = await pipe.execute()
    records: list[WorkerRecord] = []
    expired: list[str] = []
    for index, worker_id in enumerate(ids):
        data = raw[index]
        if not data:
            expired.append(worker_id)
            continue
        records.append(WorkerRecord.from_redis(data))
    if expired:
        pipe = redis.pipeline(transaction=False)
        for worker_id in expired:
            pipe.srem(keys.workers, worker_id)
            pipe.delete(keys.inflight(worker_id))
        await pipe.execute()
    return records


async def read_inflight(redis: RedisLike, keys: FleetKeys, worker_ids: list[str]) -> dict[str, int]:
    if not worker_ids:
        return {}
    pipe = redis.pipeline(transaction=False)
    for worker_id in worker_ids:
        pipe.get(keys.inflight(worker_id))
    values = await pipe.execute()
    return {w: max(0, int(v or 0)) for w, v in zip(worker_ids, values, strict=True)}


PASSIVE_TTL_S = 60.0


async def record_passive_failure(redis: RedisLike, keys: FleetKeys, worker_id: str, count: int = 1) -> None:
    """A data-path failure on a worker (5xx answered by it, upstream timeout, reset before headers)."""
    pipe = redis.pipeline(transaction=False)
    pipe.incrby(keys.passive(worker_id), count)
    pipe.pexpire(keys.passive(worker_id), _ttl_ms(PASSIVE_TTL_S))
    await pipe.execute()


async def read_passive_failures(redis: RedisLike, keys: FleetKeys, worker_ids: list[str]) -> dict[str, int]:
    """Cumulative data-path failure counts (0 when none or expired); readers compare with their last read."""
    if not worker_ids:
        return {}
    values = await redis.mget([keys.passive(w) for w in worker_ids])
    return {w: max(0, int(v or 0)) for w, v in zip(worker_ids, values, strict=True)}


async def set_worker_state(redis: RedisLike, keys: FleetKeys, worker_id: str, state: WorkerState) -> bool:
    """Change a registered worker's state and announce it; False when it is not registered."""
    return await update_live_facts(redis, keys, worker_id, announce=True, state=state.value)


async def read_queued(redis: RedisLike, keys: FleetKeys, pool: str) -> int:
    """Requests extproc replicas hold for a pool (the sum of their fields; 0 when none report)."""
    values = await redis.hvals(keys.queued(pool))
    return sum(max(0, int(v)) for v in values)
