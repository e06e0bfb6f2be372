"""Request parsing and vLLM's length rules, as pure functions."""

from __future__ import annotations

import pytest

from simworker import protocol, tokens
from simworker.protocol import WorkerApiError


@pytest.mark.parametrize(("text", "count"), [
    ("Hello there!", 3),
    ("", 0),
    ("supercalifragilistic", 3),  # words are cut into pieces of at most 8 characters
    ("<|start|>user<|sep|>hi<|end|>", 5),
    ("a,b;c", 5),
])
def test_token_counts_are_deterministic(text: str, count: int) -> None:
    assert len(tokens.tokenize(text)) == count
    assert tokens.tokenize(text) == tokens.tokenize(text)


def test_filler_tokens_are_one_token_each() -> None:
    text = protocol.generated_text(seed=12345, start=0, end=50)
    assert len(tokens.tokenize(text)) == 50


def test_block_hashes_chain_so_only_equal_prefixes_match() -> None:
    base = [f"t{i}" for i in range(40)]
    changed_late = [*base[:20], "other", *base[21:]]
    a, b = tokens.block_hashes(base, 16), tokens.block_hashes(changed_late, 16)
    assert len(a) == 2  # 40 tokens = 2 full blocks of 16
    assert a[0] == b[0] and a[1] != b[1]


def test_chat_template_overhead() -> None:
    request = protocol.parse_chat({"messages": [{"role": "user", "content": "Hello there!"}]})
    assert len(request.prompt_tokens) == 3 + 4 + 4


def test_chat_accepts_text_parts() -> None:
    request = protocol.parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a b"}]}]})
    assert "a" in request.prompt_tokens


@pytest.mark.parametrize("body", [
    [], "text", {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "user", "content": 3}]},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1.5},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": True},
    {"messages": [{"role": "user", "content": "x"}], "n": 3},
    {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
    {"messages": [{"role": "user", "content": "x"}], "model": 7},
    {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
])
def test_bad_chat_bodies_are_400(body: object) -> None:
    with pytest.raises(WorkerApiError) as raised:
        protocol.parse_chat(body)
    assert raised.value.status == 400
    assert raised.value.body()["error"]["type"] == "BadRequestError"  # type: ignore[index]


@pytest.mark.parametrize("prompt", ["", [], [["a"], ["b"]], ["a", "b"], [-1], {"t": 1}, 5])
def test_bad_prompts_are_400(prompt: object) -> None:
    with pytest.raises(WorkerApiError):
        protocol.parse_completion({"prompt": prompt})


@pytest.mark.parametrize(("prompt", "expected"), [(["hi there"], 2), ([[5, 6, 7]], 3), ([1, 2], 2)])
def test_prompt_forms(prompt: object, expected: int) -> None:
    assert len(protocol.parse_completion({"prompt": prompt}).prompt_tokens) == expected


@pytest.mark.parametrize(("prompt_len", "max_tokens", "max_model_len", "ok"), [
    (10, 90, 100, True), (10, 91, 100, False), (100, None, 100, False), (99, None, 100, True),
])
def test_context_length_rule(prompt_len: int, max_tokens: int | None, max_model_len: int, ok: bool) -> None:
    body: dict[str, object] = {"prompt": list(range(prompt_len))}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    request = protocol.parse_completion(body)
    if ok:
        plan = protocol.plan_generation(request, max_model_len)
        assert plan.prompt_tokens == prompt_len
        assert plan.output_target <= max_model_len - prompt_len
    else:
        with pytest.raises(WorkerApiError, match="maximum context length is 100"):
            protocol.plan_generation(request, max_model_len)


def test_output_stops_early_or_hits_max_tokens() -> None:
    request = protocol.parse_completion({"prompt": "a story"})
    natural = protocol.plan_generation(request, 8192)
    assert natural.finish_reason == "stop" and 1 <= natural.output_target <= 1024
    capped = protocol.plan_generation(protocol.parse_completion({"prompt": "a story", "max_tokens": 8}), 8192)
    assert (capped.finish_reason, capped.output_target) == ("length", 8)
    forced = protocol.plan_generation(
        protocol.parse_completion({"prompt": "a story", "max_tokens": 1000, "ignore_eos": True}), 8192)
    assert (forced.finish_reason, forced.output_target) == ("length", 1000)
