"""The pick: model → candidates → filters → weighted sum of scorers → the picker's choice (plus fallbacks).

``Scheduler.pick`` is pure apart from the injected random sources (the picker's ties, the sample of a large
model's workers: ``sampling``). Which filters, scorers and picker it runs comes from the registry
(``registry``), by name.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import islice

from extproc import errors
from extproc.scheduling.picker import MaxScore
from extproc.scheduling.plugins import Decision, Filter, Outcome, PickContext, Picker, PickRequest, SameScore, Scorer
from extproc.scheduling.sampling import sample, should_sample
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.routing import worker_cluster


class Scheduler:
    def __init__(
        self,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        picker: Picker | None = None,
        max_fallbacks: int = 2,
        explain: bool = False,
        sampling: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        self.filters = tuple(filters)
        self.scorers = tuple((scorer, weight) for scorer, weight in scorers if weight > 0)
        self.picker = picker or MaxScore()
        self.max_fallbacks = max_fallbacks
        self.explain = explain
        """Fill ``Decision.scores`` (for the debug header); off, a pick allocates nothing for it."""
        self.sampling = sampling
        """Pick over a sample of a large model's workers (``sampling``); off, always over every one."""
        self._rng = rng or random.Random()

    def pick(self, request: PickRequest, context: PickContext) -> Outcome:
        snapshot = context.snapshot
        model = request.model
        candidates: Sequence[WorkerRecord] = snapshot.workers_for(model)
        if not candidates and model not in snapshot.models:
            return errors.model_not_found(model)
        ready = snapshot.ready_workers_for(model)
        if self.sampling and should_sample(request, context, ready):
            outcome = self._pick_over(sample(request, context, ready, self._rng), request, context)
            if isinstance(outcome, Decision):
                return outcome
        return self._pick_over(candidates, request, context)  # every candidate: a refusal is the fleet's

    def _pick_over(self, candidates: Sequence[WorkerRecord], request: PickRequest, context: PickContext) -> Outcome:
        for candidate_filter in self.filters:
            candidates = candidate_filter.filter(request, candidates, context)
            if not candidates:
                return candidate_filter.rejection(request, context)
        if len(candidates) == 1:
            return self._decision(candidates[0], _cluster_of(candidates[0], context), (), request, context)
        scored = [(scorer.score(request, candidates, context), weight) for scorer, weight in self.scorers]
        totals, full_score = _weighted_totals(scored, len(candidates))
        first = self.picker.choose(totals, full_score)
        best = candidates[first]
        shards = _shards(context, best.pool)
        cluster = worker_cluster(best.pool, best.id, shards)
        fallbacks: tuple[str, ...] = ()
        if self.max_fallbacks:
            pool = best.pool
            same_pool = [i for i, w in enumerate(candidates) if w.pool == pool and i != first]
            if same_pool:
                same_pool.sort(key=totals.__getitem__, reverse=True)
                same_cluster = (i for i in same_pool  # a pin's hosts must all be in the cluster it names
                                if shards == 1 or worker_cluster(pool, candidates[i].id, shards) == cluster)
                fallbacks = tuple(candidates[i].address for i in islice(same_cluster, self.max_fallbacks))
        explained: tuple[tuple[str, float], ...] = ()
        if self.explain:
            explained = tuple((scorer.name, scores[first]) for (scorer, _), (scores, _) in
                              zip(self.scorers, scored, strict=True))
        return self._decision(best, cluster, fallbacks, request, context, explained)

    def _decision(self, best: WorkerRecord, cluster: str, fallbacks: tuple[str, ...], request: PickRequest,
                  context: PickContext, explained: tuple[tuple[str, float], ...] = ()) -> Decision:
        if self.explain and not explained:
            explained = tuple((scorer.name, scorer.score(request, (best,), context)[0]) for scorer, _ in self.scorers)
        return Decision(worker_id=best.id, pool=best.pool, cluster=cluster, endpoint=best.address,
                        fallbacks=fallbacks, scores=explained)


def _weighted_totals(scored: Sequence[tuple[Sequence[float], float]], count: int) -> tuple[list[float], float]:
    """Each candidate's weighted sum of its scores, less what every candidate got alike (``SameScore``: it changes
    no choice, and skipping it saves a pass over the candidates); and the full score of the scorers that spoke,
    the scale of the picker's tie band (a scorer with no opinion on this request must not widen it)."""
    totals: list[float] | None = None
    full_score = 0.0
    for scores, weight in scored:
        if isinstance(scores, SameScore):
            continue
        full_score += weight
        if totals is None:
            totals = [weight * score for score in scores]
        else:
            totals = [total + weight * score for total, score in zip(totals, scores)]  # noqa: B905 (hot path)
    return (totals, full_score) if totals is not None else ([0.0] * count, 0.0)


def _cluster_of(worker: WorkerRecord, context: PickContext) -> str:
    return worker_cluster(worker.pool, worker.id, _shards(context, worker.pool))


def _shards(context: PickContext, pool: str) -> int:
    spec = context.snapshot.pools.get(pool)
    return spec.endpoint_shards if spec is not None else 1
