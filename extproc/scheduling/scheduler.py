"""The pick: model → candidates → filters → weighted sum of scorers → best worker (plus fallbacks).

``Scheduler.pick`` is pure apart from an injected random source used only to break ties, so that several
extproc replicas facing the same state do not all pin the same worker. Totals within ``TIE_TOLERANCE`` of the
sum of weights from the best count as tied: the inputs are estimates, and a difference far below their
error (an idle worker whose prefill rate is known against one still on the default) must not send every
request to the same worker.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from extproc import errors
from extproc.scheduling.filters import (
    FitsContext,
    GpuMemoryWatermark,
    KvFits,
    ReadyAndFresh,
    TaskClassPools,
    TenantPools,
)
from extproc.scheduling.lora_filter import AdapterRoom
from extproc.scheduling.plugins import Decision, Filter, Outcome, PickContext, PickRequest, Scorer
from extproc.scheduling.saturation import SaturationGate
from extproc.scheduling.scorers.kv_headroom import KvHeadroom
from extproc.scheduling.scorers.least_inflight import LeastInflight
from extproc.scheduling.scorers.lora_affinity import LoraAffinity
from extproc.scheduling.scorers.predicted_ttft import PredictedTtft
from extproc.scheduling.scorers.prefix_affinity import PrefixAffinity
from poolgate.kernel.config import SCORER_NAMES, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.routing import cluster_name

TIE_TOLERANCE = 0.01


class Scheduler:
    def __init__(
        self,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        max_fallbacks: int = 2,
        rng: random.Random | None = None,
        explain: bool = False,
    ) -> None:
        self.filters = tuple(filters)
        self.scorers = tuple((scorer, weight) for scorer, weight in scorers if weight > 0)
        self._tolerance = TIE_TOLERANCE * sum(weight for _, weight in self.scorers)
        self.max_fallbacks = max_fallbacks
        self.explain = explain
        """Fill ``Decision.scores`` (for the debug header); off, a pick allocates nothing for it."""
        self._rng = rng or random.Random()

    def pick(self, request: PickRequest, context: PickContext) -> Outcome:
        snapshot = context.snapshot
        model = request.model
        candidates: Sequence[WorkerRecord] = snapshot.workers_for(model)
        if not candidates and model not in snapshot.models:
            return errors.model_not_found(model)
        for candidate_filter in self.filters:
            candidates = candidate_filter.filter(request, candidates, context)
            if not candidates:
                return candidate_filter.rejection(request, context)
        if len(candidates) == 1:
            return self._decision(candidates[0], (), request, context)
        scored = [(scorer.score(request, candidates, context), weight) for scorer, weight in self.scorers]
        totals = [0.0] * len(candidates)
        for scores, weight in scored:
            totals = [total + weight * score for total, score in zip(totals, scores)]  # noqa: B905 (hot path)
        floor = max(totals) - self._tolerance
        tied = [i for i, total in enumerate(totals) if total >= floor]
        first = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        best = candidates[first]
        fallbacks: tuple[str, ...] = ()
        if self.max_fallbacks:
            pool = best.pool
            same_pool = [i for i, w in enumerate(candidates) if w.pool == pool and i != first]
            if same_pool:
                same_pool.sort(key=totals.__getitem__, reverse=True)
                fallbacks = tuple(candidates[i].address for i in same_pool[:self.max_fallbacks])
        explained: tuple[tuple[str, float], ...] = ()
        if self.explain:
            explained = tuple((scorer.name, scores[first]) for (scorer, _), (scores, _) in
                              zip(self.scorers, scored, strict=True))
        return self._decision(best, fallbacks, request, context, explained)

    def _decision(self, best: WorkerRecord, fallbacks: tuple[str, ...], request: PickRequest,
                  context: PickContext, explained: tuple[tuple[str, float], ...] = ()) -> Decision:
        if self.explain and not explained:
            explained = tuple((scorer.name, scorer.score(request, (best,), context)[0]) for scorer, _ in self.scorers)
        return Decision(worker_id=best.id, pool=best.pool, cluster=cluster_name(best.pool), endpoint=best.address,
                        fallbacks=fallbacks, scores=explained)


def scorer_registry(settings: SchedulingSettings) -> dict[str, Scorer]:
    """Every scorer by the name ``scheduling.weights`` uses."""
    return {
        "predicted_ttft": PredictedTtft(settings.default_prefill_tokens_per_s, settings.ttft_reference_s),
        "kv_headroom": KvHeadroom(settings.kv_reserve_fraction),
        "inflight": LeastInflight(),
        "prefix_affinity": PrefixAffinity(),
        "lora_affinity": LoraAffinity(),
    }


def build_scheduler(settings: SchedulingSettings, rng: random.Random | None = None) -> Scheduler:
    """The resource-aware policy: pools the tenant may use, class-appropriate pools, Ready and fresh workers
    whose context, GPU memory and free KV hold the request, and (when configured) that are not saturated for
    the request's priority class; then the configured weighted sum of scorers."""
    registry = scorer_registry(settings)
    retry = settings.retry_after_s
    filters: list[Filter] = [TenantPools(retry), TaskClassPools(), ReadyAndFresh(retry), FitsContext(),
                             GpuMemoryWatermark(settings.gpu_memory_min_free_mib, retry),
                             KvFits(settings.kv_reserve_fraction, retry), AdapterRoom()]
    if settings.max_inflight_per_worker or settings.queue_when_waiting:  # off: the pick pays nothing for it
        filters.append(SaturationGate(settings.max_inflight_per_worker, settings.lower_class_inflight_fraction,
                                      settings.queue_when_waiting, retry))
    return Scheduler(
        filters=filters,
        scorers=[(registry[name], settings.weights.get(name, 0.0)) for name in SCORER_NAMES],
        rng=rng,
        explain=settings.debug_header,
    )


def default_scheduler(rng: random.Random | None = None, settings: SchedulingSettings | None = None) -> Scheduler:
    return build_scheduler(settings or SchedulingSettings(), rng)
