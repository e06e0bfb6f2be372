"""The pick: model → candidates → filters → weighted sum of scorers → best worker (plus fallbacks).

``Scheduler.pick`` is pure apart from an injected random source used only to break exact ties, so that
several extproc replicas facing the same counts do not all pin the same worker.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from extproc import errors
from extproc.errors import ApiError
from extproc.request import RequestFacts
from extproc.scheduling.filters import FitsContext, ReadyAndFresh
from extproc.scheduling.plugins import Decision, Filter, PickContext, Scorer
from extproc.scheduling.scorers.least_inflight import LeastInflight
from extproc.snapshot import FleetSnapshot
from poolgate.routing import cluster_name


class Scheduler:
    def __init__(
        self,
        filters: Sequence[Filter],
        scorers: Sequence[tuple[Scorer, float]],
        max_fallbacks: int = 2,
        rng: random.Random | None = None,
    ) -> None:
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)
        self.max_fallbacks = max_fallbacks
        self._rng = rng or random.Random()

    def pick(self, facts: RequestFacts, snapshot: FleetSnapshot, inflight: Mapping[str, int]) -> Decision | ApiError:
        if facts.model not in snapshot.by_model and facts.model not in snapshot.models:
            return errors.model_not_found(facts.model)
        context = PickContext(snapshot, inflight)
        candidates: Sequence = snapshot.workers_for(facts.model)
        for candidate_filter in self.filters:
            candidates = candidate_filter.filter(facts, candidates, context)
            if not candidates:
                return candidate_filter.rejection(facts, context)
        totals = [0.0] * len(candidates)
        for scorer, weight in self.scorers:
            for index, score in enumerate(scorer.score(facts, candidates, context)):
                totals[index] += weight * score
        ranked = sorted(range(len(candidates)), key=totals.__getitem__, reverse=True)
        top = totals[ranked[0]]
        tied = [i for i in ranked if totals[i] == top]
        first = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        best = candidates[first]
        fallbacks: list[str] = []
        for index in ranked:
            if len(fallbacks) >= self.max_fallbacks:
                break
            if index != first and candidates[index].pool == best.pool:
                fallbacks.append(candidates[index].address)
        return Decision(
            worker_id=best.id, pool=best.pool, cluster=cluster_name(best.pool), endpoint=best.address,
            fallbacks=tuple(fallbacks),
        )


def default_scheduler(rng: random.Random | None = None, retry_after_s: int = 1) -> Scheduler:
    """Walking-skeleton policy: Ready, fresh workers that fit the context; fewest in flight wins."""
    return Scheduler(
        filters=(ReadyAndFresh(retry_after_s), FitsContext()),
        scorers=((LeastInflight(), 1.0),),
        rng=rng,
    )
