"""Candidate filters: each drops the workers that must not (or cannot) take the request."""

from __future__ import annotations

from collections.abc import Sequence

from extproc import errors
from extproc.errors import ApiError
from extproc.request import RequestFacts
from extproc.scheduling.estimate import tokens_needed_lower_bound
from extproc.scheduling.plugins import PickContext
from poolgate.fleet import WorkerRecord, WorkerState

PICKABLE_STATES = frozenset({WorkerState.READY})
"""Envoy honours a pin even to a draining or unhealthy host, so only Ready workers may ever be pinned."""


class ReadyAndFresh:
    """Keeps workers that are Ready and whose live state is recent (``taken_at - updated_at <= stale_after``)."""

    name = "ready-and-fresh"

    def __init__(self, retry_after_s: int = 1) -> None:
        self.retry_after_s = retry_after_s

    def filter(
        self, facts: RequestFacts, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        snapshot = context.snapshot
        return [w for w in candidates if w.state in PICKABLE_STATES and snapshot.is_fresh(w)]

    def rejection(self, facts: RequestFacts, context: PickContext) -> ApiError:
        return errors.no_worker(facts.model, self.retry_after_s)


class FitsContext:
    """Keeps workers whose ``max_model_len`` can hold a lower bound of the prompt plus ``max_tokens``."""

    name = "fits-context"

    def filter(
        self, facts: RequestFacts, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        needed = tokens_needed_lower_bound(facts)
        return [w for w in candidates if w.max_model_len >= needed]

    def rejection(self, facts: RequestFacts, context: PickContext) -> ApiError:
        limit = max((w.max_model_len for w in context.snapshot.workers_for(facts.model)), default=0)
        return errors.context_too_long(facts.model, tokens_needed_lower_bound(facts), limit)
