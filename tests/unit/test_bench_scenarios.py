"""The peers benchmark's scenarios: seeded, at the asked rate, with the prefix structure each one promises."""

from __future__ import annotations

import collections
import itertools

import orjson
import pytest

from bench.scenarios import SCENARIOS
from simworker import protocol

MODELS = {"chat": "chat-model", "code": "code-model"}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_same_seed_same_trace_and_the_rate_is_kept(name: str) -> None:
    scenario = SCENARIOS[name]
    first = scenario.trace(4.0, 300.0, seed=5, models=MODELS)
    assert first == scenario.trace(4.0, 300.0, seed=5, models=MODELS)
    assert first.bodies != scenario.trace(4.0, 300.0, seed=6, models=MODELS).bodies
    assert len(first.requests) == pytest.approx(4.0 * 300.0, rel=0.15)
    arrivals = [r.arrival_s for r in first.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] < 300.0
    assert [r.index for r in first.requests] == list(range(len(first.requests)))


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_prompt_token_counts_match_what_the_worker_counts(name: str) -> None:
    trace = SCENARIOS[name].trace(2.0, 60.0, seed=2, models=MODELS)
    for spec, raw in list(zip(trace.requests, trace.bodies, strict=True))[:40]:
        body = orjson.loads(raw)
        parse = protocol.parse_chat if "messages" in body else protocol.parse_completion
        parsed = parse(body)
        assert len(parsed.prompt_tokens) == spec.prompt_tokens
        assert parsed.max_tokens == spec.max_tokens and not parsed.ignore_eos
        assert body["model"] == MODELS[spec.role]


def test_session_turns_extend_the_previous_prompt_with_its_answer() -> None:
    trace = SCENARIOS["sessions"].trace(3.0, 200.0, seed=1, models=MODELS)
    conversations = [orjson.loads(b)["messages"] for b in trace.bodies]
    by_start: dict[str, list[list[dict[str, str]]]] = collections.defaultdict(list)
    for messages in conversations:
        by_start[messages[1]["content"]].append(messages)  # a session's first user message names it
    multi = [turns for turns in by_start.values() if len(turns) > 1]
    assert len(multi) > 10
    for turns in multi:
        for previous, current in itertools.pairwise(turns):
            assert current[:len(previous)] == previous
            assert current[len(previous)]["role"] == "assistant"
            assert current[-1]["role"] == "user"
    systems = collections.Counter(messages[0]["content"] for messages in conversations)
    assert 2 <= len(systems) <= 4  # a few shared system prompts


def test_shared_docs_are_long_and_a_few_are_hot() -> None:
    trace = SCENARIOS["shared-docs"].trace(10.0, 200.0, seed=3, models=MODELS)
    docs = collections.Counter(orjson.loads(b)["messages"][0]["content"] for b in trace.bodies)
    assert 15 <= len(docs) <= 24
    counts = sorted(docs.values(), reverse=True)
    assert sum(counts[:3]) / sum(counts) > 0.35  # the hottest three carry over a third of the traffic
    assert all(4000 <= r.prompt_tokens - 70 <= 8000 for r in trace.requests)
    questions = [orjson.loads(b)["messages"][1]["content"] for b in trace.bodies]
    assert len(set(questions)) == len(questions)


def test_bursty_arrivals_bunch_up() -> None:
    scenario = SCENARIOS["mix"]
    steady = scenario.trace(10.0, 200.0, seed=4, models=MODELS)
    bursty = scenario.trace(10.0, 200.0, seed=4, models=MODELS, bursty=True)

    def busiest_second(times: list[float]) -> int:
        return max(collections.Counter(int(t) for t in times).values())
    assert busiest_second([r.arrival_s for r in bursty.requests]) > busiest_second(
        [r.arrival_s for r in steady.requests])
    assert len(bursty.requests) == pytest.approx(len(steady.requests), rel=0.15)


def test_a_short_sessions_trace_keeps_its_rate_from_the_first_second() -> None:
    trace = SCENARIOS["sessions"].trace(10.0, 15.0, seed=8, models=MODELS)
    assert len(trace.requests) == pytest.approx(150, rel=0.3)
    early = sum(r.arrival_s < 5.0 for r in trace.requests)
    assert early == pytest.approx(len(trace.requests) / 3, rel=0.4)
    assert any(len(orjson.loads(b)["messages"]) > 2 for b in trace.bodies[:10])  # opens mid-conversation
