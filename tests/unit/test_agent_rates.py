"""TTFT and prefill-throughput averages across scrapes (timestamps passed in, no sleeping)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.live import live_fields
from agent.rates import RateState, advance
from agent.vllm_metrics import EngineMetrics


def scrape(ttft_sum: float | None = None, ttft_count: float | None = None, prompt: float | None = None,
           running: int = 0, waiting: int = 0, prefill_time: float | None = None) -> EngineMetrics:
    return EngineMetrics(running=running, waiting=waiting, ttft_sum_s=ttft_sum, ttft_count=ttft_count,
                         prompt_tokens_total=prompt, prefill_time_sum_s=prefill_time)


def test_first_scrape_only_sets_a_baseline() -> None:
    state = advance(RateState(), scrape(ttft_sum=5.0, ttft_count=10, prompt=1000, running=2), now_s=100.0)
    assert (state.ttft_ewma_s, state.prefill_tokens_per_s) == (-1.0, 0.0)
    assert (state.at_s, state.ttft_count, state.prompt_tokens, state.busy) == (100.0, 10, 1000, True)


@pytest.mark.parametrize(("previous_ewma", "alpha", "expected"), [
    (-1.0, 0.3, 0.2),          # first interval with new requests: take the sample as it is
    (0.5, 0.3, 0.3 * 0.2 + 0.7 * 0.5),
    (0.5, 1.0, 0.2),
])
def test_ttft_is_an_ewma_of_interval_means(previous_ewma: float, alpha: float, expected: float) -> None:
    state = RateState(at_s=0.0, ttft_sum_s=1.0, ttft_count=4, ttft_ewma_s=previous_ewma)
    # 5 new first tokens that took 1.0 s together: 0.2 s each
    state = advance(state, scrape(ttft_sum=2.0, ttft_count=9), now_s=0.25, alpha=alpha)
    assert state.ttft_ewma_s == pytest.approx(expected)


@pytest.mark.parametrize("after", [
    scrape(ttft_sum=1.0, ttft_count=4),        # no new requests
    scrape(ttft_sum=0.1, ttft_count=1),        # counter reset (worker restarted)
    scrape(),                                  # histogram not exported
])
def test_ttft_keeps_its_last_value_without_new_requests(after: EngineMetrics) -> None:
    state = advance(RateState(at_s=0.0, ttft_sum_s=1.0, ttft_count=4, ttft_ewma_s=0.3), after, now_s=1.0)
    assert state.ttft_ewma_s == 0.3
    assert state.ttft_count == after.ttft_count  # the new reading is the next baseline


@pytest.mark.parametrize(("prompt_before", "prompt_after", "prefill_before", "prefill_after", "expected"), [
    (500, 1500, 2.0, 2.25, 4000.0),    # 1000 prompt tokens over 0.25 s of prefill
    (0, 8000, 0.0, 1.0, 8000.0),       # a long prompt alone
])
def test_prefill_rate_is_prompt_tokens_per_prefill_second(prompt_before: float, prompt_after: float,
                                                          prefill_before: float, prefill_after: float,
                                                          expected: float) -> None:
    state = RateState(at_s=10.0, prompt_tokens=prompt_before, prefill_time_sum_s=prefill_before)
    # Wall time between scrapes (5 s here) does not dilute it: idle and decode time are not prefill.
    state = advance(state, scrape(prompt=prompt_after, prefill_time=prefill_after), now_s=15.0)
    assert state.prefill_tokens_per_s == pytest.approx(expected)


def test_prefill_rate_is_smoothed() -> None:
    state = RateState(at_s=0.0, prompt_tokens=0, prefill_time_sum_s=0.0, prefill_tokens_per_s=1000.0)
    state = advance(state, scrape(prompt=500, running=1, prefill_time=0.25), now_s=0.25, alpha=0.5)
    assert state.prefill_tokens_per_s == pytest.approx(0.5 * 2000 + 0.5 * 1000)


@pytest.mark.parametrize(("state", "after", "now_s"), [
    (RateState(at_s=0.0, prompt_tokens=100, prefill_time_sum_s=1.0), scrape(prompt=100, prefill_time=1.0), 1.0),
    (RateState(at_s=0.0, prompt_tokens=900, prefill_time_sum_s=1.0), scrape(prompt=50, prefill_time=1.2), 1.0),
    (RateState(at_s=0.0, prompt_tokens=100), scrape(prompt=200, running=1), 1.0),  # no prefill histogram
    (RateState(prompt_tokens=None), scrape(prompt=200, prefill_time=1.0), 1.0),    # no baseline
])
def test_prefill_rate_unchanged_without_evidence(state: RateState, after: EngineMetrics, now_s: float) -> None:
    state = replace(state, prefill_tokens_per_s=123.0)
    assert advance(state, after, now_s).prefill_tokens_per_s == 123.0


def test_prefill_rate_counts_only_the_prompt_tokens_the_cache_did_not_hold() -> None:
    """6,000 prompt tokens in a second of prefill, 5,000 of them prefix-cache hits: 1,000 computed per second,
    not 6,000 (a worker serving cached documents must not read as six times faster than it is)."""
    before = replace(scrape(prompt=0.0, prefill_time=0.0), prefix_cache_hits_total=0.0,
                     prefix_cache_queries_total=0.0)
    after = replace(scrape(prompt=6000.0, prefill_time=1.0), prefix_cache_hits_total=5000.0,
                    prefix_cache_queries_total=6000.0)
    state = advance(advance(RateState(), before, 0.0), after, 1.0)
    assert state.prefill_tokens_per_s == pytest.approx(1000.0)
    assert state.prefix_cache_hit_rate == pytest.approx(5000 / 6000)


def test_the_gap_between_a_streams_tokens_is_an_ewma_of_interval_means() -> None:
    state = advance(RateState(), EngineMetrics(inter_token_sum_s=10.0, inter_token_count=200), now_s=0.0)
    assert state.inter_token_ewma_s == -1.0  # a baseline only
    state = advance(state, EngineMetrics(inter_token_sum_s=12.0, inter_token_count=240), now_s=0.25)
    assert state.inter_token_ewma_s == pytest.approx(0.05)  # 40 gaps in 2 s
    state = advance(state, EngineMetrics(inter_token_sum_s=12.0, inter_token_count=240), now_s=0.5)
    assert state.inter_token_ewma_s == pytest.approx(0.05)  # nothing written: the last value stays
    state = advance(state, EngineMetrics(inter_token_sum_s=13.0, inter_token_count=250), now_s=0.75)
    assert state.inter_token_ewma_s == pytest.approx(0.3 * 0.1 + 0.7 * 0.05)
    assert live_fields(EngineMetrics(), state, None)["inter_token_s"] == pytest.approx(0.065)
