"""The benchmarks' request mix: seeded, in proportion, in range, exact prompt token counts, client-style caps,
prompt text whose characters per token differ from a flat 4, Poisson and on/off arrivals."""

from __future__ import annotations

import collections
import itertools
import random

import orjson
import pytest

from bench import workload
from simworker import protocol
from simworker.tokens import tokenize


def test_same_seed_same_trace_and_other_seed_differs() -> None:
    first = workload.poisson_trace(5.0, 60.0, seed=11)
    assert first == workload.poisson_trace(5.0, 60.0, seed=11)
    assert first != workload.poisson_trace(5.0, 60.0, seed=12)


def test_arrivals_are_poisson_at_the_rate() -> None:
    trace = workload.poisson_trace(20.0, 500.0, seed=3)
    assert len(trace) == pytest.approx(20.0 * 500.0, rel=0.05)
    arrivals = [r.arrival_s for r in trace]
    assert arrivals == sorted(arrivals) and 0 <= arrivals[0] and arrivals[-1] < 500.0
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    mean = sum(gaps) / len(gaps)
    variance = sum((g - mean) ** 2 for g in gaps) / len(gaps)
    assert mean == pytest.approx(1 / 20.0, rel=0.05)
    assert variance ** 0.5 == pytest.approx(mean, rel=0.1)  # exponential: std == mean


def test_mix_proportions_over_a_large_sample() -> None:
    trace = workload.poisson_trace(100.0, 200.0, seed=5)
    counts = collections.Counter(r.workload for r in trace)
    for workload_class in workload.MIX:
        assert counts[workload_class.name] / len(trace) == pytest.approx(workload_class.share, abs=0.015)
    chat = [r for r in trace if r.workload == "chat"]
    assert sum(r.nominal_stream for r in chat) / len(chat) == pytest.approx(0.5, abs=0.03)
    assert all(r.nominal_stream for r in trace if r.workload == "long_stream")
    assert not any(r.nominal_stream for r in trace if r.workload in ("code", "summarisation"))


def test_lengths_respect_each_class_range_and_caps_are_generous_or_absent() -> None:
    trace = workload.poisson_trace(100.0, 100.0, seed=9)
    for request in trace:
        spec = workload.CLASSES[request.workload]
        assert spec.prompt_range[0] <= request.prompt_tokens <= spec.prompt_range[1]
        assert request.max_tokens is None or request.max_tokens >= 128
        assert request.slo_ttft_s == spec.slo_ttft_s
    chat = sorted(r.prompt_tokens for r in trace if r.workload == "chat")
    assert chat[len(chat) // 2] == pytest.approx(400, rel=0.1)
    chat_caps = [r.max_tokens for r in trace if r.workload == "chat"]
    assert chat_caps.count(None) / len(chat_caps) == pytest.approx(0.15, abs=0.03)


@pytest.mark.parametrize("name", [c.name for c in workload.MIX])
def test_bodies_give_the_simulator_the_intended_prompt_and_leave_the_length_to_the_model(name: str) -> None:
    trace = [r for r in workload.poisson_trace(50.0, 20.0, seed=1) if r.workload == name][:20]
    assert trace
    for request in trace:
        body = orjson.loads(workload.request_body(request, "m"))
        parse = protocol.parse_chat if request.path == workload.CHAT_PATH else protocol.parse_completion
        parsed = parse(body)
        assert len(parsed.prompt_tokens) == request.prompt_tokens
        assert parsed.max_tokens == request.max_tokens and not parsed.ignore_eos
        assert parsed.stream and body["model"] == "m" and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(("style", "low", "high"), [("prose", 4.4, 5.0), ("code", 3.0, 3.8)])
def test_prompt_text_is_not_four_characters_per_token(style: workload.TextStyle, low: float, high: float) -> None:
    text = workload.prompt_text(5000, seed=3, style=style)
    tokens = len(tokenize(text))
    assert tokens == 5000
    assert low < (len(text) + 1) / tokens < high


def test_bursty_arrivals_keep_the_mean_rate_and_burst_in_their_on_phase() -> None:
    arrivals = workload.Arrivals(10.0, bursty=True, period_s=10.0, on_share=0.4, on_factor=2.0)
    times = arrivals.times(2000.0, random.Random(4))
    assert len(times) == pytest.approx(10.0 * 2000.0, rel=0.05)
    on = sum(1 for t in times if t % 10.0 < 4.0)
    assert on / 4.0 == pytest.approx(20.0 * 200, rel=0.05)  # 2 × the mean rate in the on phase
    assert (len(times) - on) / 6.0 == pytest.approx(10.0 * 200 * (1 - 0.8) / 0.6, rel=0.08)
    with pytest.raises(ValueError):
        workload.Arrivals(10.0, bursty=True, on_share=0.6, on_factor=2.0).times(10.0, random.Random(1))


def test_bad_trace_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        workload.poisson_trace(0.0, 10.0, seed=1)
    with pytest.raises(ValueError):
        workload.prompt_text(0, seed=1)
