"""Rates that need two scrapes: recent time to first token, observed prefill throughput, prefix-cache hit rate,
time between a stream's tokens.

Both are exponentially weighted moving averages of per-interval samples, so a single odd interval does not
swing routing. Timestamps are passed in (no clock here). A counter that went backwards means the worker
restarted: the pair is skipped and the new reading becomes the baseline, keeping the averages.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from agent.vllm_metrics import EngineMetrics

DEFAULT_ALPHA = 0.3
"""Weight of the newest sample; at 4 scrapes a second, older samples fade within about a second."""


@dataclass(frozen=True)
class RateState:
    """What one worker's derivation carries from one scrape to the next."""

    at_s: float | None = None
    """Monotonic time of the previous scrape; None before the first."""
    ttft_sum_s: float | None = None
    ttft_count: float | None = None
    prompt_tokens: float | None = None
    busy: bool = False
    ttft_ewma_s: float = -1.0
    """-1 = unknown (no request has finished its first token since the agent started)."""
    prefill_time_sum_s: float | None = None
    prefill_tokens_per_s: float = 0.0
    """0 = unknown."""
    prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hit_rate: float = -1.0
    """Cached share of the prompt tokens looked up per interval; -1 = unknown (no lookup yet)."""
    inter_token_sum_s: float | None = None
    inter_token_count: float | None = None
    inter_token_ewma_s: float = -1.0
    """Mean time between a stream's tokens per interval; -1 = unknown (no stream has written a second token)."""


def advance(state: RateState, metrics: EngineMetrics, now_s: float, alpha: float = DEFAULT_ALPHA) -> RateState:
    """Fold one scrape taken at ``now_s`` into the averages."""
    busy = bool((metrics.running or 0) + (metrics.waiting or 0))
    ttft = state.ttft_ewma_s
    ttft_seconds = _delta(state.ttft_sum_s, metrics.ttft_sum_s)
    first_tokens = _delta(state.ttft_count, metrics.ttft_count)
    if ttft_seconds is not None and first_tokens:  # else no request got its first token: keep the last value
        ttft = ewma(ttft, ttft_seconds / first_tokens, alpha, unknown=-1.0)
    hit_rate = state.prefix_cache_hit_rate
    hits = _delta(state.prefix_cache_hits, metrics.prefix_cache_hits_total)
    queries = _delta(state.prefix_cache_queries, metrics.prefix_cache_queries_total)
    if hits is not None and queries:  # no prompt looked up this interval: keep the last value
        hit_rate = ewma(hit_rate, min(1.0, hits / queries), alpha, unknown=-1.0)
    inter_token = state.inter_token_ewma_s
    gap_seconds = _delta(state.inter_token_sum_s, metrics.inter_token_sum_s)
    gaps = _delta(state.inter_token_count, metrics.inter_token_count)
    if gap_seconds is not None and gaps:  # no stream wrote a token this interval: keep the last value
        inter_token = ewma(inter_token, gap_seconds / gaps, alpha, unknown=-1.0)
    prefill = state.prefill_tokens_per_s
    prompt_delta = _delta(state.prompt_tokens, metrics.prompt_tokens_total)
    prefill_seconds = _delta(state.prefill_time_sum_s, metrics.prefill_time_sum_s)
    # Prompt tokens computed per second of prefill time (vLLM's prefill-phase histogram): the worker's real
    # prompt speed under its current batching, unlike tokens per wall second, which idle and decode time
    # dilute. The prefix cache's hits were not computed: counted in, a worker serving cached prompts would
    # read tens of times faster than it is (a 6k-token cached document "prefilled" in one step). Engines
    # without that histogram leave the rate unknown and the scheduler uses its default.
    if prompt_delta and prefill_seconds:
        computed = prompt_delta - (hits or 0.0)
        if computed > 0:
            prefill = ewma(prefill, computed / prefill_seconds, alpha, unknown=0.0)
    return replace(state, at_s=now_s, ttft_sum_s=metrics.ttft_sum_s, ttft_count=metrics.ttft_count,
                   prompt_tokens=metrics.prompt_tokens_total, prefill_time_sum_s=metrics.prefill_time_sum_s,
                   busy=busy, ttft_ewma_s=ttft,
                   prefill_tokens_per_s=prefill, prefix_cache_hits=metrics.prefix_cache_hits_total,
                   prefix_cache_queries=metrics.prefix_cache_queries_total, prefix_cache_hit_rate=hit_rate,
                   inter_token_sum_s=metrics.inter_token_sum_s, inter_token_count=metrics.inter_token_count,
                   inter_token_ewma_s=inter_token)


def _delta(before: float | None, after: float | None) -> float | None:
    """Growth of a counter; None when either reading is missing or the counter was reset."""
    if before is None or after is None or after < before:
        return None
    return after - before


def ewma(previous: float, sample: float, alpha: float, unknown: float) -> float:
    """The moving average of the interval samples; ``previous`` at ``unknown`` takes the sample as it is."""
    return sample if previous == unknown else alpha * sample + (1 - alpha) * previous
