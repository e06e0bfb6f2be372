"""The saturation gate: a busy worker takes no more requests of the lower priority classes.

The KV filter refuses a worker only when the request's tokens no longer fit, which happens long after the
worker is slow: every request admitted into a running batch makes each decode step longer for all of them,
so a flood of low-priority requests raises the time to first token of everyone. The gate holds requests in
extproc's priority queue (where the classes are served in strict order) instead of in the engine's batch
(where they are not):

    load(w)      = max(running(w) + waiting(w), inflight(w))
    limit(class) = max_inflight_per_worker                             for the highest class (0)
                 = max_inflight_per_worker × lower_class_inflight_fraction   for every lower class
    saturated    = load(w) ≥ limit(class)
                   or (queue_when_waiting and class > 0 and waiting(w) > 0)

``running``/``waiting`` are what the agent last read from the engine; ``inflight`` is extproc's own count
across replicas, exact at once for this replica's placements, so back-to-back picks see each other before
the agent's next scrape. The headroom between the two limits is kept for the highest class: when lower
classes burst, the highest still finds a worker at once. A lower class never overtakes a higher one in the
queue, so holding it costs the fleet no throughput while higher classes wait too.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.scheduling.plugins import FilterPlugin, NoCapacity, NoSettings, PickContext, PickRequest, Refusal
from poolgate.kernel.config import SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord


class SaturationGate:
    """Drops workers whose load reaches the request's class limit (see the module docstring)."""

    name = "saturated"
    reason = "saturated"

    def __init__(self, max_inflight_per_worker: int, lower_class_fraction: float = 1.0,
                 queue_when_waiting: bool = False, retry_after_s: int = 1) -> None:
        self.max_inflight_per_worker = max_inflight_per_worker
        """0 = no concurrency limit (the waiting rule may still apply)."""
        self.lower_class_fraction = lower_class_fraction
        self.queue_when_waiting = queue_when_waiting
        self.retry_after_s = retry_after_s
        lower = max_inflight_per_worker * lower_class_fraction
        self._limits = (float(max_inflight_per_worker), max(1.0, lower) if max_inflight_per_worker else 0.0)
        """Limit of the highest class and of every lower class (0 = none)."""

    def limit(self, priority: int) -> float:
        """The load at which a worker is saturated for ``priority`` (0 = no limit)."""
        return self._limits[0 if priority <= 0 else 1]

    def filter(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        lower = request.priority > 0
        limit = self.limit(request.priority)
        no_waiting = self.queue_when_waiting and lower
        if not limit and not no_waiting:
            return candidates
        inflight = context.inflight.get
        kept = []
        for w in candidates:
            if no_waiting and w.waiting > 0:
                continue
            if limit and max(w.running + w.waiting, inflight(w.id, 0)) >= limit:
                continue
            kept.append(w)
        return kept

    def rejection(self, request: PickRequest, context: PickContext) -> Refusal:
        return NoCapacity(request.model, self.reason, self.retry_after_s)


def _gate(own: NoSettings, s: SchedulingSettings) -> SaturationGate | None:
    if not (s.max_inflight_per_worker or s.queue_when_waiting):
        return None
    return SaturationGate(s.max_inflight_per_worker, s.lower_class_inflight_fraction, s.queue_when_waiting,
                          s.retry_after_s)


PLUGIN: FilterPlugin[NoSettings] = FilterPlugin("saturated", _gate, NoSettings)
