"""A frozen picture of the fleet that the scheduler decides over, so a pick never waits on Redis, and the
index that keeps it current from changes.

Built from the worker records read from Redis plus the configured pools. Freshness is judged against the
time the records were read (``taken_at``): if Redis goes away, the last picture keeps serving unchanged
(degraded, visible in a metric) rather than every worker turning stale at once.

``FleetIndex`` builds each snapshot from the previous one: a change to a worker updates the served names
it answers to (before and after the change), whose tuples are then copied from dicts, and the ``by_id``
shard it lives in; every other name's tuples and every other shard are the previous snapshot's own
objects. Time passing is a change too: a worker turns stale once its ``updated_at`` falls behind the
staleness bound (unless the fleet is ``vouched``), and its agent facts stop being believed once its
``metrics_at`` does (``trusted``). Each worker's next such moment waits in a heap, so an update in which
no record changed and no moment passed returns the very same snapshot, and a kept snapshot judges every
worker as one built at that later time would.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from poolgate.kernel.config import PoolSpec
from poolgate.kernel.fleet import UNKNOWN_AGENT_FACTS, WorkerRecord, WorkerState

BY_ID_SHARDS = 64
"""``by_id`` is split by hash into this many dicts, so one worker's change copies about 1/64 of the fleet
(156 entries at 10,000 workers), not all of it."""


class ShardedById(Mapping[str, WorkerRecord]):
    """Worker id → record, in ``BY_ID_SHARDS`` dicts that snapshots share until one of them changes."""

    __slots__ = ("_count", "_shards")

    def __init__(self, shards: tuple[Mapping[str, WorkerRecord], ...], count: int) -> None:
        self._shards = shards
        self._count = count

    def __getitem__(self, worker_id: str) -> WorkerRecord:
        return self._shards[hash(worker_id) % BY_ID_SHARDS][worker_id]

    def get(self, worker_id: str, default: WorkerRecord | None = None) -> WorkerRecord | None:  # type: ignore[override]
        return self._shards[hash(worker_id) % BY_ID_SHARDS].get(worker_id, default)

    def __contains__(self, worker_id: object) -> bool:
        return isinstance(worker_id, str) and worker_id in self._shards[hash(worker_id) % BY_ID_SHARDS]

    def __iter__(self) -> Iterator[str]:
        return itertools.chain.from_iterable(self._shards)

    def __len__(self) -> int:
        return self._count

    def records(self) -> tuple[WorkerRecord, ...]:
        return tuple(itertools.chain.from_iterable(shard.values() for shard in self._shards))

    def changed_since(self, before: ShardedById) -> set[str]:
        """Ids added, removed or holding another record than in ``before``; the shards both share are
        skipped (a change copies only its own shard, so this costs the changed shards)."""
        changed: set[str] = set()
        for now, then in zip(self._shards, before._shards, strict=True):
            if now is not then:
                changed.update(worker_id for worker_id in now.keys() | then.keys()
                               if now.get(worker_id) is not then.get(worker_id))
        return changed


def _no_workers() -> ShardedById:
    return ShardedById(tuple({} for _ in range(BY_ID_SHARDS)), 0)


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    by_model: Mapping[str, tuple[WorkerRecord, ...]]
    """Served name → workers of configured pools that answer to it, sorted by id."""
    models: tuple[str, ...]
    """Every model name clients may ask for: configured pool models, then workers' other served names."""
    taken_at: float
    """Wall-clock time (same clock as ``WorkerRecord.updated_at``) when the records were read: freshness is
    judged against it. A snapshot kept because nothing changed judges as a rebuild would, so the fleet's
    age is the reader's to tell (extproc's watcher: ``synced_at``)."""
    stale_after_s: float
    pools: Mapping[str, PoolSpec] = field(default_factory=lambda: MappingProxyType({}))
    by_id: ShardedById = field(default_factory=_no_workers)
    """Every worker of a configured pool (the whole fleet the snapshot holds)."""
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
    stale_workers: int = 0
    """Workers whose live state is too old to pick (not ``is_fresh``)."""
    vouched: bool = False
    """The registry listed every worker here at ``taken_at`` (extproc's watcher: a record expires a TTL after
    its heartbeats stop, and heartbeats are not re-read one by one), so each counts as seen then, whatever
    its ``updated_at``; False: each worker's ``updated_at`` is when it was last seen."""

    @property
    def workers(self) -> tuple[WorkerRecord, ...]:
        """Every worker, in no particular order; built on each call (it walks the whole fleet: for readers
        that look at every worker once per snapshot, never per pick)."""
        return self.by_id.records()

    def workers_for(self, model: str) -> tuple[WorkerRecord, ...]:
        return self.by_model.get(model, ())

    def ready_workers_for(self, model: str) -> tuple[WorkerRecord, ...]:
        return self.ready_by_model.get(model, ())

    def seen_at(self, worker: WorkerRecord) -> float:
        """When the worker was last known alive."""
        return max(worker.updated_at, self.taken_at) if self.vouched else worker.updated_at

    def is_fresh(self, worker: WorkerRecord) -> bool:
        return self.seen_at(worker) >= self.taken_at - self.stale_after_s


def trusted(record: WorkerRecord, oldest: float) -> WorkerRecord:
    """The record with its agent-observed facts reset to "unknown" when the agent last read them before
    ``oldest``: a worker that still heartbeats is kept, but its old KV and queue numbers are not believed."""
    if 0 < record.metrics_at < oldest:
        return record.with_live(**UNKNOWN_AGENT_FACTS)
    return record


_gpu_memory_free = operator.attrgetter("gpu_memory_free_mib")
_READY = WorkerState.READY  # bound once: an enum member costs a class lookup each time it is named


def _names(record: WorkerRecord, pool_model: str) -> tuple[str, ...]:
    """Served names a worker answers to: its own and its pool's model."""
    names = record.served_names or (record.model,)
    if len(names) > 1:
        names = tuple(dict.fromkeys(names))
    return names if pool_model in names else (*names, pool_model)


class _Served:
    """One served name's workers and what the filters read about them, kept worker by worker: a change
    costs the worker, and the name's tuples are copied from dicts (in C) when a snapshot is assembled."""

    __slots__ = ("least_free", "lengths", "ready", "ready_top", "restricted", "top", "unsorted", "workers")

    def __init__(self) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        """By id, in id order unless ``unsorted``."""
        self.ready: dict[str, WorkerRecord] = {}
        """The Ready and fresh ones, the same way."""
        self.top = self.ready_top = ""
        """At least the last id in each dict: one that comes in below it breaks the order (``unsorted``)."""
        self.unsorted = False
        self.lengths: dict[int, int] = {}
        """``max_model_len`` → how many workers have it."""
        self.least_free: float | None = math.inf
        """The least known free GPU memory; None: to be found again (the worker that had it changed)."""
        self.restricted = 0
        """Workers of class-restricted pools."""

    def drop(self, worker_id: str, record: WorkerRecord, restricted: bool) -> None:
        del self.workers[worker_id]
        self.ready.pop(worker_id, None)
        self._forget(record, restricted)

    def put(self, worker_id: str, record: WorkerRecord, ready: bool, restricted: bool,
            replacing: tuple[WorkerRecord, bool] | None) -> None:
        """Add the worker, or (``replacing``: the record it had here and whether its pool was restricted)
        update it in place, so the id order holds."""
        if replacing is not None:
            self._forget(*replacing)
        elif worker_id < self.top:
            self.unsorted = True
        else:
            self.top = worker_id
        self.workers[worker_id] = record
        if ready:
            if worker_id not in self.ready:
                if worker_id < self.ready_top:
                    self.unsorted = True
                else:
                    self.ready_top = worker_id
            self.ready[worker_id] = record
        elif replacing is not None:
            self.ready.pop(worker_id, None)
        self.lengths[record.max_model_len] = self.lengths.get(record.max_model_len, 0) + 1
        free = record.gpu_memory_free_mib
        if 0 <= free and self.least_free is not None and free < self.least_free:
            self.least_free = free
        if restricted:
            self.restricted += 1

    def _forget(self, record: WorkerRecord, restricted: bool) -> None:
        count = self.lengths[record.max_model_len] - 1
        if count:
            self.lengths[record.max_model_len] = count
        else:
            del self.lengths[record.max_model_len]
        if self.least_free is not None and 0 <= record.gpu_memory_free_mib <= self.least_free:
            self.least_free = None
        if restricted:
            self.restricted -= 1

    def least_gpu_memory_free(self) -> float:
        if self.least_free is None:
            self.least_free = min([free for free in map(_gpu_memory_free, self.workers.values()) if free >= 0],
                                  default=math.inf)
        return self.least_free

    def in_order(self) -> None:
        if self.unsorted:
            self.workers = dict(sorted(self.workers.items()))
            self.ready = dict(sorted(self.ready.items()))
            self.top = next(reversed(self.workers), "")
            self.ready_top = next(reversed(self.ready), "")
            self.unsorted = False


class FleetIndex:
    """The fleet snapshot, rebuilt from changes where they land (see the module docstring); ``snapshot`` is
    the latest. Workers of pools missing from the config are left out: Envoy has no cluster for them."""

    def __init__(self, pools: Iterable[PoolSpec], stale_after_s: float, *, vouched: bool = False) -> None:
        """``vouched``: every record given is known alive at each update's time (``FleetSnapshot.vouched``),
        so no worker turns stale by its ``updated_at``; agent facts still age (``trusted``)."""
        self._pools = MappingProxyType({pool.name: pool for pool in pools})
        self._pool_task_classes = MappingProxyType(
            {pool.name: frozenset(pool.task_classes) for pool in self._pools.values() if pool.task_classes})
        self._pool_models = tuple(dict.fromkeys(pool.model for pool in self._pools.values()))
        self._stale_after_s = stale_after_s
        self._vouched = vouched
        self._inputs: dict[str, WorkerRecord] = {}
        """Worker id → the record as given (judged again when one of its moments passes)."""
        self._shards: list[dict[str, WorkerRecord]] = [{} for _ in range(BY_ID_SHARDS)]
        """Worker id → the record as the snapshot holds it (``trusted``), by shard."""
        self._owned: set[int] = set()
        """Shards copied since the last snapshot, so free to change in place."""
        self._count = 0
        self._stale: set[str] = set()
        self._served: dict[str, _Served] = {}
        self._by_model: dict[str, tuple[WorkerRecord, ...]] = {}
        self._ready: dict[str, tuple[WorkerRecord, ...]] = {}
        self._smallest_len: dict[str, int] = {}
        self._least_gpu_free: dict[str, float] = {}
        self._restricted: set[str] = set()
        self._models = self._pool_models
        self._moments: list[tuple[float, str]] = []
        """Heap of (time, worker id): when the worker's record is next judged differently (once ``time``
        falls below ``taken_at - stale_after_s``: it turns stale, or its agent facts too old). Entries of
        records since replaced are skipped when they come up; they hold no record, so cost little meanwhile."""
        self.snapshot = self._assemble(0.0)

    def update(self, changes: Mapping[str, WorkerRecord | None], taken_at: float, *,
               renew: bool = False) -> FleetSnapshot:
        """Apply ``changes`` (id → its record now, None: gone) and what time passing changed by ``taken_at``;
        the same snapshot object when neither changed anything it holds, unless ``renew`` (then at least a
        copy dated ``taken_at``: a vouched fleet seen again)."""
        oldest = taken_at - self._stale_after_s
        touched: set[str] = set()
        for worker_id, record in changes.items():
            self._put(worker_id, record, oldest, touched)
        moments = self._moments
        while moments and moments[0][0] < oldest:
            at, worker_id = heapq.heappop(moments)
            record = self._inputs.get(worker_id)
            if record is not None and at in (record.updated_at, record.metrics_at):  # not since replaced
                self._put(worker_id, record, oldest, touched)
        if touched:
            indexed = touched.intersection(self._by_model)
            for name in touched:
                self._reindex(name)
            if touched.intersection(self._by_model) != indexed:  # a name came or went
                self._models = tuple(dict.fromkeys((*self._pool_models, *sorted(self._by_model))))
            self.snapshot = self._assemble(taken_at)
        elif renew:
            self.snapshot = dataclasses.replace(self.snapshot, taken_at=taken_at)
        return self.snapshot

    def replace(self, records: Iterable[WorkerRecord], taken_at: float) -> FleetSnapshot:
        """The fleet is ``records`` now (those not among them are gone)."""
        changes: dict[str, WorkerRecord | None] = dict.fromkeys(self._inputs)
        changes.update((record.id, record) for record in records)
        return self.update(changes, taken_at)

    def _put(self, worker_id: str, record: WorkerRecord | None, oldest: float, touched: set[str]) -> None:
        """Take ``record`` as the worker's (None or an unconfigured pool: it leaves) and mark the served names
        whose index it changed."""
        pool = self._pools.get(record.pool) if record is not None else None
        shard_index = hash(worker_id) % BY_ID_SHARDS
        before = self._shards[shard_index].get(worker_id)
        if record is None or pool is None:
            if before is None:
                return
            del self._inputs[worker_id]
            self._stale.discard(worker_id)
            after = None
            names_after: tuple[str, ...] = ()
        else:
            self._inputs[worker_id] = record
            self._schedule(worker_id, record, oldest)
            after = trusted(record, oldest)
            stale = not self._vouched and record.updated_at < oldest
            if (before is not None and stale == (worker_id in self._stale)
                    and after.updated_at == before.updated_at and after == before):
                return
            if stale:
                self._stale.add(worker_id)
            else:
                self._stale.discard(worker_id)
            names_after = _names(after, pool.model)
        replacing: tuple[WorkerRecord, bool] | None = None
        if before is not None:
            replacing = (before, before.pool in self._pool_task_classes)
            for name in _names(before, self._pools[before.pool].model):
                if name not in names_after:
                    self._served[name].drop(worker_id, *replacing)
                    touched.add(name)
        shard = self._owned_shard(shard_index)
        if after is None:
            del shard[worker_id]
            self._count -= 1
            return
        if before is None:
            self._count += 1
        shard[worker_id] = after
        ready = after.state is _READY and not stale and not after.sleep_level  # a sleeping engine cannot serve
        restricted = after.pool in self._pool_task_classes
        for name in names_after:
            served = self._served.get(name)
            if served is None:
                served = self._served[name] = _Served()
            served.put(worker_id, after, ready, restricted, replacing if worker_id in served.workers else None)
            touched.add(name)

    def _schedule(self, worker_id: str, record: WorkerRecord, oldest: float) -> None:
        """Queue the next moment the record is judged differently: it turns stale, or its facts too old."""
        at = record.updated_at if not self._vouched and record.updated_at >= oldest else math.inf
        if 0 < record.metrics_at and oldest <= record.metrics_at < at:
            at = record.metrics_at
        if at < math.inf:
            heapq.heappush(self._moments, (at, worker_id))

    def _owned_shard(self, index: int) -> dict[str, WorkerRecord]:
        if index not in self._owned:
            self._shards[index] = dict(self._shards[index])
            self._owned.add(index)
        return self._shards[index]

    def _reindex(self, name: str) -> None:
        """Take one served name's entries from its ``_Served`` (or drop them: no worker answers to it)."""
        served = self._served.get(name)
        if served is None or not served.workers:
            self._served.pop(name, None)
            for index in (self._by_model, self._ready, self._smallest_len, self._least_gpu_free):
                index.pop(name, None)
            self._restricted.discard(name)
            return
        served.in_order()
        self._by_model[name] = tuple(served.workers.values())
        self._ready[name] = tuple(served.ready.values())
        self._smallest_len[name] = min(served.lengths)
        self._least_gpu_free[name] = served.least_gpu_memory_free()
        if served.restricted:
            self._restricted.add(name)
        else:
            self._restricted.discard(name)

    def _assemble(self, taken_at: float) -> FleetSnapshot:
        self._owned.clear()
        return FleetSnapshot(
            by_model=MappingProxyType(dict(self._by_model)),
            models=self._models,
            taken_at=taken_at,
            stale_after_s=self._stale_after_s,
            pools=self._pools,
            by_id=ShardedById(tuple(self._shards), self._count),
            pool_task_classes=self._pool_task_classes,
            class_restricted_models=frozenset(self._restricted),
            ready_by_model=MappingProxyType(dict(self._ready)),
            smallest_max_model_len=MappingProxyType(dict(self._smallest_len)),
            least_gpu_memory_free_mib=MappingProxyType(dict(self._least_gpu_free)),
            stale_workers=len(self._stale),
            vouched=self._vouched,
        )


def build_snapshot(
    records: Iterable[WorkerRecord], pools: Iterable[PoolSpec], taken_at: float, stale_after_s: float, *,
    vouched: bool = False,
) -> FleetSnapshot:
    """The snapshot of ``records`` alone, built in one go. Agent facts older than ``stale_after_s`` count as
    unknown (see ``trusted``)."""
    return FleetIndex(pools, stale_after_s, vouched=vouched).replace(records, taken_at)


def empty_snapshot(pools: Iterable[PoolSpec], stale_after_s: float) -> FleetSnapshot:
    return FleetIndex(pools, stale_after_s).snapshot
