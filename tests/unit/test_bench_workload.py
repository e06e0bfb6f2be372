"""The scheduling benchmark's trace generator: seeded, in proportion, in range, exact token counts."""

from __future__ import annotations

import collections
import itertools

import orjson
import pytest

from bench import workload
from simworker import protocol


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


def test_lengths_respect_each_class_range() -> None:
    trace = workload.poisson_trace(100.0, 100.0, seed=9)
    for request in trace:
        spec = workload.CLASSES[request.workload]
        assert spec.prompt_range[0] <= request.prompt_tokens <= spec.prompt_range[1]
        assert spec.output_range[0] <= request.output_tokens <= spec.output_range[1]
        assert request.slo_ttft_s == spec.slo_ttft_s
    chat = sorted(r.prompt_tokens for r in trace if r.workload == "chat")
    assert chat[len(chat) // 2] == pytest.approx(400, rel=0.1)
    chat_out = sorted(r.output_tokens for r in trace if r.workload == "chat")
    assert chat_out[len(chat_out) // 2] == pytest.approx(150, rel=0.1)


@pytest.mark.parametrize("name", [c.name for c in workload.MIX])
def test_bodies_give_the_simulator_the_intended_token_counts(name: str) -> None:
    trace = [r for r in workload.poisson_trace(50.0, 20.0, seed=1) if r.workload == name][:20]
    assert trace
    for request in trace:
        body = orjson.loads(workload.request_body(request, "m"))
        parse = protocol.parse_chat if request.path == workload.CHAT_PATH else protocol.parse_completion
        parsed = parse(body)
        assert len(parsed.prompt_tokens) == request.prompt_tokens
        plan = protocol.plan_generation(parsed, max_model_len=32768)
        assert plan.output_target == request.output_tokens
        assert parsed.stream and parsed.ignore_eos and body["model"] == "m"


def test_bad_trace_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        workload.poisson_trace(0.0, 10.0, seed=1)
    with pytest.raises(ValueError):
        workload.prompt_text(0, seed=1)
