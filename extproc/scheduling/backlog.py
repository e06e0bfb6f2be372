"""The prefill-backlog gate: a worker whose engine queue already holds more prefill than a bound takes no
new request now; it waits in extproc's queue, where it is ordered by deadline and prefill (``flow_queue``)
instead of joining the engine's first-in-first-out queue behind long prefills.

For candidate w, with P_w the request's prompt tokens that w's cache does not hold (the KV-event index's
cached prefix; the whole prompt where unknown), and waiting_w, pending_w, rate_w as ``predicted_ttft`` has
them (engine-reported waiting requests, each assumed about as long as this one; prompt tokens placed there
that the record does not show yet, counted without their cached part; the measured prefill rate):

    backlog(w) = (waiting_w × P_w + pending_w) / rate_w
    kept       = backlog(w) ≤ max_prefill_backlog_s + held_s

held_s is how long the request has already waited in extproc's queue: the bound loosens by it, so a request
is never held much longer than it would have queued in the engine, and an idle worker (no backlog) always
takes it. A short (or mostly cached) request passes where a long prefill is held, which is the point.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.scheduling.plugins import FilterPlugin, NoCapacity, NoSettings, PickContext, PickRequest, Refusal
from poolgate.kernel.config import SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord


class PrefillBacklogGate:
    name = "prefill_backlog"
    reason = "prefill-backlog"

    def __init__(self, max_backlog_s: float, default_prefill_tokens_per_s: float, retry_after_s: int = 1) -> None:
        self.max_backlog_s = max_backlog_s
        self.default_rate = default_prefill_tokens_per_s
        self.retry_after_s = retry_after_s

    def filter(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[WorkerRecord]:
        pending = context.pending_prefill_tokens.get
        if not any(w.waiting or pending(w.id, 0) for w in candidates):
            return candidates
        bound = self.max_backlog_s + request.held_s
        prompt = request.prompt_tokens
        blocks, view = request.prompt_blocks, context.prefix_cache
        cached = view.cached_tokens(blocks, candidates) if blocks is not None and view is not None else {}
        if blocks is not None:
            prompt = blocks.token_count
        kept = []
        for w in candidates:
            rate = w.prefill_tokens_per_s if w.prefill_tokens_per_s > 0 else self.default_rate
            uncached = prompt - cached.get(w.id, 0)
            if (w.waiting * uncached + pending(w.id, 0)) / rate <= bound:
                kept.append(w)
        return kept

    def rejection(self, request: PickRequest, context: PickContext) -> Refusal:
        return NoCapacity(request.model, self.reason, self.retry_after_s)


def _gate(own: NoSettings, s: SchedulingSettings) -> PrefillBacklogGate | None:
    if not s.max_prefill_backlog_s:
        return None
    return PrefillBacklogGate(s.max_prefill_backlog_s, s.default_prefill_tokens_per_s, s.retry_after_s)


PLUGIN: FilterPlugin[NoSettings] = FilterPlugin("prefill_backlog", _gate, NoSettings)
