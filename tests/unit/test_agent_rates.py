"""TTFT and prefill-throughput averages across scrapes (timestamps passed in, no sleeping)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from controller.agent.rates import RateState, advance
from controller.agent.vllm_metrics import EngineMetrics


def scrape(ttft_sum: float | None = None, ttft_count: float | None = None, prompt: float | None = None,
           running: int = 0, waiting: int = 0) -> EngineMetrics:
    return EngineMetrics(running=running, waiting=waiting, ttft_sum_s=ttft_sum, ttft_count=ttft_count,
                         prompt_tokens_total=prompt)


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


@pytest.mark.parametrize(("was_busy", "running", "waiting", "expected"), [
    (True, 1, 0, 4000.0),      # 1000 prompt tokens over 0.25 s
    (False, 0, 3, 4000.0),     # became busy during the interval
    (True, 0, 0, 4000.0),      # finished during the interval
])
def test_prefill_rate_from_prompt_tokens_while_busy(was_busy: bool, running: int, waiting: int,
                                                    expected: float) -> None:
    state = RateState(at_s=10.0, prompt_tokens=500, busy=was_busy)
    state = advance(state, scrape(prompt=1500, running=running, waiting=waiting), now_s=10.25)
    assert state.prefill_tokens_per_s == pytest.approx(expected)


def test_prefill_rate_is_smoothed() -> None:
    state = RateState(at_s=0.0, prompt_tokens=0, busy=True, prefill_tokens_per_s=1000.0)
    state = advance(state, scrape(prompt=500, running=1), now_s=0.25, alpha=0.5)
    assert state.prefill_tokens_per_s == pytest.approx(0.5 * 2000 + 0.5 * 1000)


@pytest.mark.parametrize(("state", "after", "now_s"), [
    (RateState(at_s=0.0, prompt_tokens=100, busy=False), scrape(prompt=200), 1.0),   # idle at both ends
    (RateState(at_s=0.0, prompt_tokens=100, busy=True), scrape(prompt=100, running=1), 1.0),  # decode only
    (RateState(at_s=0.0, prompt_tokens=900, busy=True), scrape(prompt=50, running=1), 1.0),   # reset
    (RateState(at_s=1.0, prompt_tokens=100, busy=True), scrape(prompt=200, running=1), 1.0),  # no time passed
    (RateState(prompt_tokens=None, busy=True), scrape(prompt=200, running=1), 1.0),          # no baseline
])
def test_prefill_rate_unchanged_without_evidence(state: RateState, after: EngineMetrics, now_s: float) -> None:
    state = replace(state, prefill_tokens_per_s=123.0)
    assert advance(state, after, now_s).prefill_tokens_per_s == 123.0
