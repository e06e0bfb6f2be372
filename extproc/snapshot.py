"""A frozen picture of the fleet that the scheduler decides over, so a pick never waits on Redis.

Built from the worker records read from Redis plus the configured pools. Freshness is judged against the
time the records were read (``taken_at``): if Redis goes away, the last picture keeps serving unchanged
(degraded, visible in a metric) rather than every worker turning stale at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import UNKNOWN_AGENT_FACTS, WorkerRecord, WorkerState


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    workers: tuple[WorkerRecord, ...]
    by_model: Mapping[str, tuple[WorkerRecord, ...]]
    """Served name → workers of configured pools that answer to it."""
    models: tuple[str, ...]
    """Every model name clients may ask for: configured pool models and workers' served names."""
    taken_at: float
    """Wall-clock time (same clock as ``WorkerRecord.updated_at``) when the records were read."""
    stale_after_s: float
    pools: Mapping[str, PoolSpec] = field(default_factory=lambda: MappingProxyType({}))
    by_id: Mapping[str, WorkerRecord] = field(default_factory=lambda: MappingProxyType({}))
    pool_task_classes: Mapping[str, frozenset[str]] = field(default_factory=lambda: MappingProxyType({}))
    """Pool → the task classes it takes, for pools that restrict them (absent = takes every class)."""
    class_restricted_models: frozenset[str] = frozenset()
    """Served names with at least one class-restricted pool among their workers' pools."""
    ready_by_model: Mapping[str, tuple[WorkerRecord, ...]] = field(default_factory=lambda: MappingProxyType({}))
    """Served name → its Ready workers that are fresh at ``taken_at`` (known when the records are read)."""
    smallest_max_model_len: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Served name → the smallest ``max_model_len`` among its workers (a request below it fits them all)."""
    least_gpu_memory_free_mib: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Served name → the least free GPU memory its workers report (unknown counts as unlimited)."""

    def workers_for(self, model: str) -> tuple[WorkerRecord, ...]:
        return self.by_model.get(model, ())

    def ready_workers_for(self, model: str) -> tuple[WorkerRecord, ...]:
        return self.ready_by_model.get(model, ())

    def is_fresh(self, worker: WorkerRecord) -> bool:
        return self.taken_at - worker.updated_at <= self.stale_after_s

    def stale_count(self) -> int:
        return sum(1 for w in self.workers if not self.is_fresh(w))


def trusted(record: WorkerRecord, oldest: float) -> WorkerRecord:
    """The record with its agent-observed facts reset to "unknown" when the agent last read them before
    ``oldest``: a worker that still heartbeats is kept, but its old KV and queue numbers are not believed."""
    if 0 < record.metrics_at < oldest:
        return record.with_live(**UNKNOWN_AGENT_FACTS)
    return record


def build_snapshot(
    records: Iterable[WorkerRecord], pools: Iterable[PoolSpec], taken_at: float, stale_after_s: float
) -> FleetSnapshot:
    """Index workers by served name. Workers of pools missing from the config are left out: Envoy has no
    cluster for them. Agent facts older than ``stale_after_s`` count as unknown (see ``trusted``)."""
    pool_map = {pool.name: pool for pool in pools}
    oldest = taken_at - stale_after_s
    workers = tuple(sorted((trusted(r, oldest) for r in records if r.pool in pool_map), key=lambda r: r.id))
    by_model: dict[str, list[WorkerRecord]] = {}
    for worker in workers:
        names = dict.fromkeys((*worker.names, pool_map[worker.pool].model))
        for name in names:
            by_model.setdefault(name, []).append(worker)
    models = dict.fromkeys(pool.model for pool in pool_map.values())
    models.update(dict.fromkeys(by_model))
    pool_task_classes = {pool.name: frozenset(pool.task_classes) for pool in pool_map.values() if pool.task_classes}
    restricted = frozenset(name for name, ws in by_model.items() if any(w.pool in pool_task_classes for w in ws))
    ready_by_model = {name: tuple(w for w in ws if w.state is WorkerState.READY and w.updated_at >= oldest)
                      for name, ws in by_model.items()}
    smallest_len = {name: min(w.max_model_len for w in ws) for name, ws in by_model.items()}
    least_gpu_free = {name: min((w.gpu_memory_free_mib for w in ws if w.gpu_memory_free_mib >= 0), default=math.inf)
                      for name, ws in by_model.items()}
    return FleetSnapshot(
        workers=workers,
        by_model=MappingProxyType({name: tuple(ws) for name, ws in by_model.items()}),
        models=tuple(models),
        taken_at=taken_at,
        stale_after_s=stale_after_s,
        pools=MappingProxyType(pool_map),
        by_id=MappingProxyType({w.id: w for w in workers}),
        pool_task_classes=MappingProxyType(pool_task_classes),
        class_restricted_models=restricted,
        ready_by_model=MappingProxyType(ready_by_model),
        smallest_max_model_len=MappingProxyType(smallest_len),
        least_gpu_memory_free_mib=MappingProxyType(least_gpu_free),
    )


def empty_snapshot(pools: Iterable[PoolSpec], stale_after_s: float) -> FleetSnapshot:
    return build_snapshot((), pools, taken_at=0.0, stale_after_s=stale_after_s)
