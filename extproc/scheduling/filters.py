"""Candidate filters: each drops the workers that must not (or cannot) take the request.

Order matters only for the answer when nothing is left: the first filter that empties the list explains
why. Filters that judge the request (task class, context length) come before those that judge the workers'
present load (KV, GPU memory), whose refusal is a ``NoCapacity`` the service may wait out.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc import errors
from extproc.scheduling.kv import kv_footprint, kv_free_tokens, kv_room_after
from extproc.scheduling.plugins import FilterPlugin, NoCapacity, NoSettings, PickContext, PickRequest, Refusal
from extproc.snapshot import FleetSnapshot
from poolgate.kernel.fleet import WorkerRecord, WorkerState


class TenantPools:
    """Keeps workers of pools the request's tenant may use: never a pool dedicated to another tenant, and
    only its own dedicated pools when it is restricted to them. Costs nothing when no pool is dedicated."""

    name = "tenant_pools"

    def __init__(self, retry_after_s: int = 1) -> None:
        self.retry_after_s = retry_after_s

    def filter(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        only, excluded = request.only_pools, request.excluded_pools
        if only is not None:
            return [w for w in candidates if w.pool in only]
        if excluded:
            return [w for w in candidates if w.pool not in excluded]
        return candidates

    def rejection(self, request: PickRequest, context: PickContext) -> Refusal:
        if not context.snapshot.workers_for(request.model):
            return errors.no_worker(request.model, self.retry_after_s)  # nobody serves it: not about rights
        return errors.model_not_allowed(request.model)


class TaskClassPools:
    """Keeps workers of pools that take the request's task class (a pool with no ``task_classes`` takes all).

    When no pool of the model takes the class, every pool of the model may serve it: a class-restricted
    fleet then still answers rather than refusing requests nobody planned for.
    """

    name = "task_class"

    def filter(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        snapshot = context.snapshot
        if request.model not in snapshot.class_restricted_models:
            return candidates
        restricted = snapshot.pool_task_classes
        wanted = request.task_class
        kept = [w for w in candidates if w.pool not in restricted or wanted in restricted[w.pool]]
        return kept or candidates

    def rejection(self, request: PickRequest, context: PickContext) -> Refusal:
        return errors.no_worker(request.model)  # unreachable: the filter never empties a non-empty list


class ReadyAndFresh:
    """Keeps workers that are Ready, awake and were seen recently (``taken_at - seen_at <= stale_after``).
    Envoy honours a pin even to a draining or unhealthy host, so only Ready workers may ever be pinned; a
    sleeping vLLM engine (``sleep_level``) still answers its health probe but cannot serve.

    When none is left but a Busy one (healthy, its KV cache full with requests waiting: the controller's
    verdict, ``controller/health.py``), the request has nowhere to go now rather than nowhere at all: it is held
    in the queue like a request no worker has room for, and placed when the worker is Ready again. Answering
    503 instead turned a burst on a one-worker pool into 182 refusals of 200 in the second the worker was Busy.
    """

    name = "ready_and_fresh"
    reason = "busy"

    def __init__(self, retry_after_s: int = 1) -> None:
        self.retry_after_s = retry_after_s

    def filter(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        snapshot = context.snapshot
        if candidates is snapshot.workers_for(request.model):  # the whole model: use the snapshot's index
            return snapshot.ready_workers_for(request.model)
        return _awake_and_fresh(candidates, WorkerState.READY, snapshot)

    def rejection(self, request: PickRequest, context: PickContext) -> Refusal:
        snapshot = context.snapshot
        if _awake_and_fresh(snapshot.workers_for(request.model), WorkerState.BUSY, snapshot):
            return NoCapacity(request.model, self.reason, self.retry_after_s)
        return errors.no_worker(request.model, self.retry_after_s)


def _awake_and_fresh(workers: Sequence[WorkerRecord], state: WorkerState,
                     snapshot: FleetSnapshot) -> list[WorkerRecord]:
    """The workers in ``state``, awake and seen within ``stale_after_s`` of the snapshot."""
    if snapshot.vouched:  # every worker was seen at ``taken_at``
        return [w for w in workers if w.state is state and not w.sleep_level]
    oldest = snapshot.taken_at - snapshot.stale_after_s
    return [w for w in workers if w.state is state and not w.sleep_level and w.updated_at >= oldest]


class FitsContext:
    """Keeps workers whose ``max_model_len`` holds the estimated prompt plus the expected output.

    When none does, keeps those that hold the prompt's lower bound plus ``max_tokens`` (or one token): the
    engine accepts such a request (it caps the output), so only when even that fails is the answer 400.
    """

    name = "fits_context"

    def filter(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        expected = request.total_tokens
        if expected <= context.snapshot.smallest_max_model_len.get(request.model, 0):
            return candidates  # fits every worker of the model: no need to look at each
        kept = [w for w in candidates if w.max_model_len >= expected]
        if kept:
            return kept
        needed = _hard_minimum(request)
        return [w for w in candidates if w.max_model_len >= needed]

    def rejection(self, request: PickRequest, context: PickContext) -> Refusal:
        limit = max((w.max_model_len for w in context.snapshot.workers_for(request.model)), default=0)
        return errors.context_too_long(request.model, _hard_minimum(request), limit)


def _hard_minimum(request: PickRequest) -> int:
    return request.min_prompt_tokens + (request.facts.max_tokens or 1)


class GpuMemoryWatermark:
    """Drops workers that report less free GPU memory than ``gpu_memory_min_free_mib`` (unknown = kept)."""

    name = "gpu_memory"
    reason = "gpu-memory"

    def __init__(self, min_free_mib: float, retry_after_s: int = 1) -> None:
        self.min_free_mib = min_free_mib
        self.retry_after_s = retry_after_s

    def filter(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        floor = self.min_free_mib
        if floor <= 0 or context.snapshot.least_gpu_memory_free_mib.get(request.model, 0.0) >= floor:
            return candidates
        return [w for w in candidates if not 0 <= w.gpu_memory_free_mib < floor]

    def rejection(self, request: PickRequest, context: PickContext) -> Refusal:
        return NoCapacity(request.model, self.reason, self.retry_after_s)


class KvFits:
    """Keeps workers whose free KV tokens hold the request's footprint (prompt plus expected output in whole
    KV blocks: ``kv.kv_footprint``), less the prompt's blocks the worker's cache already holds as its events
    confirmed (the KV-event index; ``kv.kv_room_after``). Blocks only pending there (a prompt just placed,
    not computed yet) are not counted: requests admitted together each allocate their own copy.

    free = capacity × (1 − usage − kv_reserve_fraction) − reserved, where reserved is extproc's optimistic
    count of what it placed on the worker since the record was written plus the decode room of its open
    streams. A footprint larger than a whole empty worker only needs an empty worker. Unknown capacity (0:
    not reported yet) counts as fitting; the KV headroom scorer rates it low.
    """

    name = "kv_fits"
    reason = "kv-fits"

    def __init__(self, reserve_fraction: float, retry_after_s: int = 1) -> None:
        self.reserve_fraction = reserve_fraction
        self.retry_after_s = retry_after_s

    def filter(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        reserved = context.reserved_kv_tokens
        total = request.total_tokens
        blocks, view = request.prompt_blocks, context.prefix_cache
        cached = (view.cached_tokens(blocks, candidates, pending=False) if blocks is not None and view is not None
                  else None)
        room = kv_room_after(candidates, total, self.reserve_fraction, reserved, cached)
        return [w for w, left in zip(candidates, room, strict=True)
                if left >= 0 or self._fits_only_empty(w, total, reserved.get(w.id, 0))]

    def _fits_only_empty(self, worker: WorkerRecord, tokens: int, reserved_tokens: int) -> bool:
        """A footprint larger than the whole usable cache fits only an empty worker."""
        usable = worker.kv_capacity_tokens * (1.0 - self.reserve_fraction)
        return (kv_footprint(tokens, worker.kv_block_size) > usable
                and kv_free_tokens(worker, self.reserve_fraction, reserved_tokens) >= usable)

    def rejection(self, request: PickRequest, context: PickContext) -> Refusal:
        return NoCapacity(request.model, self.reason, self.retry_after_s)


TENANT_POOLS: FilterPlugin[NoSettings] = FilterPlugin(
    "tenant_pools", lambda own, shared: TenantPools(shared.retry_after_s), NoSettings)
TASK_CLASS: FilterPlugin[NoSettings] = FilterPlugin("task_class", lambda own, shared: TaskClassPools(), NoSettings)
READY_AND_FRESH: FilterPlugin[NoSettings] = FilterPlugin(
    "ready_and_fresh", lambda own, shared: ReadyAndFresh(shared.retry_after_s), NoSettings)
FITS_CONTEXT: FilterPlugin[NoSettings] = FilterPlugin("fits_context", lambda own, shared: FitsContext(), NoSettings)
GPU_MEMORY: FilterPlugin[NoSettings] = FilterPlugin(
    "gpu_memory", lambda own, shared: GpuMemoryWatermark(shared.gpu_memory_min_free_mib, shared.retry_after_s),
    NoSettings)
KV_FITS: FilterPlugin[NoSettings] = FilterPlugin(
    "kv_fits", lambda own, shared: KvFits(shared.kv_reserve_fraction, shared.retry_after_s), NoSettings)
