"""Cold starts: which requests wait for a pool scaled to zero to get its first worker, and for how long.

A pool may scale to zero when autoscaling is on and its ``autoscale.pools`` entry has ``min_workers: 0``.
A request that finds no Ready worker among the pools it may use, when one of those pools may scale to zero,
waits in the hold stage's queue instead of getting 503: the queue's count for the pool reaches the
autoscaler (``watcher.held_per_pool``), which starts a worker for an empty pool with anything waiting, and
the release pass places the request once the worker is Ready. The wait is bounded by the pool's
``cold_start_wait_s`` (the longest of the request's pools), after which the answer is a 503 with Retry-After
(``errors.cold_start_timeout``). Pools that cannot scale to zero keep the immediate 503.

Pure: a lookup over the configured bounds and the live snapshot, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from extproc.scheduling import PickRequest
from extproc.snapshot import FleetSnapshot
from poolgate.kernel.config import AutoscaleSettings, PoolSpec
from poolgate.kernel.fleet import WorkerRecord

COLD_START_RETRY_AFTER_S = 10
"""Retry-After of a cold start that ran past its wait: the worker is usually only seconds from Ready then."""
ENDPOINT_SETTLE_S = 0.5
"""A request waiting for a cold start goes to the new worker only this long after it registered: Envoy learns
the endpoint over xDS from the same registry change extproc sees, and a pin to a host its empty cluster does not
have yet fails as "no healthy upstream" (measured: extproc placed 3 ms after registration, before EDS arrived)."""


class ColdStarts:
    def __init__(self, waits: Mapping[str, Mapping[str, float]] | None = None) -> None:
        """``waits``: served model → pool that may scale to zero → its cold-start wait in seconds."""
        self._waits = MappingProxyType({model: dict(pools) for model, pools in (waits or {}).items() if pools})

    @classmethod
    def from_config(cls, pools: tuple[PoolSpec, ...] | list[PoolSpec], autoscale: AutoscaleSettings) -> ColdStarts:
        waits: dict[str, dict[str, float]] = {}
        if autoscale.enabled:
            for pool in pools:
                bounds = autoscale.pools.get(pool.name)
                if bounds is not None and bounds.min_workers == 0:
                    waits.setdefault(pool.model, {})[pool.name] = bounds.cold_start_wait_s
        return cls(waits)

    def __bool__(self) -> bool:
        return bool(self._waits)

    def wait_s(self, request: PickRequest, snapshot: FleetSnapshot) -> float | None:
        """How long ``request`` may wait for a cold start now; None when it may not (no pool it may use can
        scale to zero, or one of them has a Ready worker: then it waits for capacity like any request)."""
        pools = self._waits.get(request.model)
        if not pools:
            return None
        only, excluded = request.only_pools, request.excluded_pools
        waits = [wait for name, wait in pools.items() if (only is None or name in only) and name not in excluded]
        if not waits:
            return None
        for worker in snapshot.ready_workers_for(request.model):
            if (only is None or worker.pool in only) and worker.pool not in excluded:
                return None
        return max(waits)


def settled(worker: WorkerRecord | None, now: float) -> bool:
    """The worker registered long enough ago for Envoy to route to it (``ENDPOINT_SETTLE_S``)."""
    return worker is not None and now - worker.registered_at >= ENDPOINT_SETTLE_S
