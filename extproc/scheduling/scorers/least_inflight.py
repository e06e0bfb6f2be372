"""Least in-flight: prefer the worker with the fewest requests in flight through extproc.

score(w) = (max_n - n_w) / (max_n - min_n), or 1 for every candidate when all counts are equal,
where n_w is the worker's in-flight count across extproc replicas and max_n / min_n range over candidates.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.scheduling.plugins import NoSettings, PickContext, PickRequest, SameScore, ScorerPlugin
from poolgate.kernel.fleet import WorkerRecord


class LeastInflight:
    name = "inflight"

    def score(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[float]:
        inflight = context.inflight
        counts = [inflight.get(w.id, 0) for w in candidates]
        low, high = min(counts), max(counts)
        if high == low:
            return SameScore(len(counts), 1.0)
        span = high - low
        return [(high - n) / span for n in counts]


PLUGIN: ScorerPlugin[NoSettings] = ScorerPlugin("inflight", lambda own, shared: LeastInflight(), NoSettings)
