"""Predicted time to first token: prefer the worker that would start this request's first token soonest.

t(w) = (waiting_w × P + pending_w + P) / rate_w, where P is this request's estimated prompt tokens (each
request the engine reports waiting is assumed to be about as long: the engine does not report queued
tokens), pending_w the prompt tokens this replica placed on w that its record does not show yet, and rate_w
the worker's observed prefill tokens per second (``scheduling.default_prefill_tokens_per_s`` while unknown).

score(w) = t_ref / (t_ref + t(w)), with t_ref = ``scheduling.ttft_reference_s``: 1 for an idle worker, 0.5
at t_ref, towards 0 as the queue grows. An absolute scale (rather than min–max across candidates) keeps a
small difference between two idle workers from looking like a large one.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.scheduling.plugins import NoSettings, PickContext, PickRequest, ScorerPlugin
from poolgate.kernel.fleet import WorkerRecord


class PredictedTtft:
    name = "predicted_ttft"

    def __init__(self, default_prefill_tokens_per_s: float, reference_s: float) -> None:
        self.default_rate = default_prefill_tokens_per_s
        self.reference_s = reference_s

    def score(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[float]:
        prompt = request.prompt_tokens
        pending = context.pending_prefill_tokens.get
        default_rate = self.default_rate
        reference = self.reference_s
        return [
            reference / (reference + ((w.waiting + 1) * prompt + pending(w.id, 0))
                         / (w.prefill_tokens_per_s if w.prefill_tokens_per_s > 0 else default_rate))
            for w in candidates
        ]


PLUGIN: ScorerPlugin[NoSettings] = ScorerPlugin(
    "predicted_ttft", lambda own, shared: PredictedTtft(shared.default_prefill_tokens_per_s, shared.ttft_reference_s),
    NoSettings)
