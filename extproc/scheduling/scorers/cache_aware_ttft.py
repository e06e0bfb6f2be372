"""Cache-aware predicted time to first token: the prefill a worker must do is only the part of the prompt
its KV cache does not already hold, known exactly from the workers' KV events.

For each candidate w, with P the prompt's tokens (exact: the tokenised prompt) and c_w the tokens of its
leading blocks that w's cache holds:

    c_w = the index's cached prefix (w's event stream is in sync), else s_w × P with s_w the approximate
          affinity strength (``prefix_affinity``'s score: where this session or prefix went last), since an
          unknown worker may hold anything but is never assumed empty or full
    t(w) = ((waiting_w + 1) × (P − c_w) + pending_w) / rate_w
    score(w) = t_ref / (t_ref + t(w))

pending_w, rate_w and t_ref are ``predicted_ttft``'s (pending_w counts placed prompts without the part their
worker caches). Each request the engine reports waiting is assumed to cost what this one costs *there*: the
requests that queue at a worker are mostly the ones its cache drew (the same documents, sessions, system
prompts), so a warm worker's queue is made of cheap prefills and a cold one's of full ones. The trade-off
between a warm busy worker and an idle cold one falls out of t(w): a worker holding 6k of a 6.5k prompt
behind three waiting requests (4 × 0.5k) beats an idle one that must prefill all 6.5k, and loses to it once
its queue costs more than the prefill it saves.

Without precise knowledge for the request (not tokenised, or no candidate's stream in sync) every
candidate scores 0: the weight then changes no pick, and ``predicted_ttft`` and ``prefix_affinity`` decide
as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.scheduling.plugins import NoSettings, PickContext, PickRequest, SameScore, ScorerPlugin
from extproc.scheduling.scorers.prefix_affinity import PrefixAffinity
from poolgate.kernel.fleet import WorkerRecord


class CacheAwareTtft:
    name = "cache_aware_ttft"

    def __init__(self, default_prefill_tokens_per_s: float, reference_s: float) -> None:
        self.default_rate = default_prefill_tokens_per_s
        self.reference_s = reference_s
        self._affinity = PrefixAffinity()

    def score(
        self, request: PickRequest, candidates: Sequence[WorkerRecord], context: PickContext
    ) -> Sequence[float]:
        blocks, view = request.prompt_blocks, context.prefix_cache
        if blocks is None or view is None:
            return SameScore(len(candidates))
        cached = view.cached_tokens(blocks, candidates)
        if not cached:
            return SameScore(len(candidates))
        prompt = blocks.token_count
        affinity = self._affinity.score(request, candidates, context)
        pending = context.pending_prefill_tokens.get
        reference = self.reference_s
        scores: list[float] = []
        for worker, strength in zip(candidates, affinity, strict=True):
            hit = cached.get(worker.id)
            if hit is None:
                hit = int(strength * prompt)
            rate = worker.prefill_tokens_per_s if worker.prefill_tokens_per_s > 0 else self.default_rate
            seconds = ((worker.waiting + 1) * (prompt - hit) + pending(worker.id, 0)) / rate
            scores.append(reference / (reference + seconds))
        return scores


PLUGIN: ScorerPlugin[NoSettings] = ScorerPlugin(
    "cache_aware_ttft",
    lambda own, shared: CacheAwareTtft(shared.default_prefill_tokens_per_s, shared.ttft_reference_s), NoSettings)
