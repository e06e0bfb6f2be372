"""extproc's refresh against a real Redis: a refresh that finds nothing new keeps the snapshot (its age is
counted from the last read, not from the last rebuild), a change rebuilds only its model's index, and a
worker whose heartbeats stop leaves once its record expires."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.watcher import FleetWatcher
from poolgate.kernel.config import ExtprocSettings, PoolSpec
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.store import FleetStore
from tests.manual_clock import ManualClock

POOLS = (PoolSpec(name="chat", model="llama"), PoolSpec(name="code", model="coder"))
KEYS = RedisKeys("snapshot-refresh-test")
SETTINGS = ExtprocSettings(stale_after_s=3.0)


def record(worker_id: str, pool: str, port: int) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool=pool, model="llama" if pool == "chat" else "coder", host="127.0.0.1",
                        port=port)


def age(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("poolgate_extproc_snapshot_age_seconds") or 0.0


async def test_nothing_new_keeps_the_snapshot_and_a_change_rebuilds_only_its_model(redis_client: Any) -> None:
    store = FleetStore(redis_client, KEYS.prefix)
    await store.register(record("w1", "chat", 9001), ttl_s=60)
    await store.register(record("w2", "code", 9002), ttl_s=60)
    clock = ManualClock(time.time())
    metrics = Metrics()
    watcher = FleetWatcher(store, POOLS, SETTINGS, InflightTracker(), metrics, clock=clock)
    assert await watcher.refresh()
    first = watcher.snapshot
    assert [w.id for w in first.ready_workers_for("llama")] == ["w1"]

    clock.now += 0.5
    assert await watcher.refresh()
    assert watcher.snapshot is first
    assert age(metrics) == 0.0  # the fleet was read just now, though the snapshot was built 0.5 s ago

    clock.now += SETTINGS.stale_after_s / 2  # half a bound since it was built: the fleet is vouched for again
    assert await watcher.refresh()
    renewed = watcher.snapshot
    assert renewed is not first and renewed.taken_at == clock.now and renewed.by_model is first.by_model

    assert await store.heartbeat("w2", ttl_s=60, kv_usage=0.4)  # a live fact of one worker
    clock.now += 0.1
    assert await watcher.refresh()
    changed = watcher.snapshot
    assert changed.by_id["w2"].kv_usage == 0.4
    assert changed.by_model["llama"] is renewed.by_model["llama"]  # the other model's index is reused
    assert changed.by_model["coder"] is not renewed.by_model["coder"]


async def test_a_worker_whose_heartbeats_stop_leaves_once_its_record_expires(redis_client: Any) -> None:
    store = FleetStore(redis_client, KEYS.prefix)
    await store.register(record("w1", "chat", 9001), ttl_s=60)
    await store.register(record("w2", "code", 9002), ttl_s=0.2)  # and no heartbeat after that
    watcher = FleetWatcher(store, POOLS, SETTINGS, InflightTracker(), Metrics())
    assert await watcher.refresh()
    kept = watcher.snapshot
    assert [w.id for w in kept.ready_workers_for("coder")] == ["w2"]
    await asyncio.sleep(0.4)
    assert await watcher.refresh()
    assert watcher.snapshot.ready_workers_for("coder") == () and "w2" not in watcher.snapshot.by_id
    assert watcher.snapshot.by_model["llama"] is kept.by_model["llama"]
