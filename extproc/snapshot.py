"""A frozen picture of the fleet that the scheduler decides over, so a pick never waits on Redis.

Built from the worker records read from Redis plus the configured pools. Freshness is judged against the
time the records were read (``taken_at``): if Redis goes away, the last picture keeps serving unchanged
(degraded, visible in a metric) rather than every worker turning stale at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from poolgate.config import PoolSpec
from poolgate.fleet import WorkerRecord


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

    def workers_for(self, model: str) -> tuple[WorkerRecord, ...]:
        return self.by_model.get(model, ())

    def is_fresh(self, worker: WorkerRecord) -> bool:
        return self.taken_at - worker.updated_at <= self.stale_after_s

    def stale_count(self) -> int:
        return sum(1 for w in self.workers if not self.is_fresh(w))


def build_snapshot(
    records: Iterable[WorkerRecord], pools: Iterable[PoolSpec], taken_at: float, stale_after_s: float
) -> FleetSnapshot:
    """Index workers by served name. Workers of pools missing from the config are left out: Envoy has no
    cluster for them."""
    pool_map = {pool.name: pool for pool in pools}
    workers = tuple(sorted((r for r in records if r.pool in pool_map), key=lambda r: r.id))
    by_model: dict[str, list[WorkerRecord]] = {}
    for worker in workers:
        names = dict.fromkeys((*worker.names, pool_map[worker.pool].model))
        for name in names:
            by_model.setdefault(name, []).append(worker)
    models = dict.fromkeys(pool.model for pool in pool_map.values())
    models.update(dict.fromkeys(by_model))
    return FleetSnapshot(
        workers=workers,
        by_model=MappingProxyType({name: tuple(ws) for name, ws in by_model.items()}),
        models=tuple(models),
        taken_at=taken_at,
        stale_after_s=stale_after_s,
        pools=MappingProxyType(pool_map),
    )


def empty_snapshot(pools: Iterable[PoolSpec], stale_after_s: float) -> FleetSnapshot:
    return build_snapshot((), pools, taken_at=0.0, stale_after_s=stale_after_s)
