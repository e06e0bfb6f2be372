"""Request parsing: what routing needs, and an OpenAI-style 400 for every malformed body."""

from __future__ import annotations

import orjson
import pytest

from extproc.errors import ApiError
from extproc.request import RequestFacts, RequestHead, facts_from_data, load_body, parse_head
from poolgate.kernel.routing import CLUSTER_HEADER, DESTINATION_ENDPOINT_KEY

CHAT = RequestHead("POST", "/v1/chat/completions", None)
COMPLETIONS = RequestHead("POST", "/v1/completions", None)


def parse_request(head: RequestHead, body: bytes) -> RequestFacts | ApiError:
    """What the resolve stage does first: the body as a JSON object, then the facts routing needs."""
    data = load_body(body)
    return data if isinstance(data, ApiError) else facts_from_data(head, data)


def test_head_reads_pseudo_headers_and_client_routing_headers() -> None:
    head = parse_head([(":method", "post"), (":path", "/v1/chat/completions?x=1"), ("content-length", "42"),
                       ("x-request-id", "abc"), (CLUSTER_HEADER, "pool-evil"),
                       (DESTINATION_ENDPOINT_KEY.upper(), "1.2.3.4:5"), (CLUSTER_HEADER, "again")])
    assert head == RequestHead("POST", "/v1/chat/completions", 42, (CLUSTER_HEADER, DESTINATION_ENDPOINT_KEY),
                               "abc")
    assert head.is_inference and not head.is_model_list


@pytest.mark.parametrize(("method", "path", "inference", "models"), [
    ("POST", "/v1/completions", True, False),
    ("GET", "/v1/chat/completions", False, False),
    ("GET", "/v1/models", False, True),
    ("POST", "/v1/embeddings", False, False),
    ("GET", "/health", False, False),
])
def test_which_paths_are_routed(method: str, path: str, inference: bool, models: bool) -> None:
    head = parse_head([(":method", method), (":path", path)])
    assert (head.is_inference, head.is_model_list) == (inference, models)


def test_chat_facts() -> None:
    body = {"model": "m", "stream": True, "max_tokens": 16,
            "messages": [{"role": "system", "content": "abcd"},
                         {"role": "user", "content": [{"type": "text", "text": "xyz"}, {"type": "image_url"}]},
                         {"role": "assistant", "content": None, "tool_calls": []}]}
    facts = parse_request(CHAT, orjson.dumps(body))
    assert facts == RequestFacts("/v1/chat/completions", "POST", "m", stream=True, max_tokens=16, prompt_chars=7,
                                 message_count=3, prompt_parts=("abcd", "xyz"))


@pytest.mark.parametrize(("header", "user", "expected"), [
    (None, None, ""),
    ("s-1", None, "s-1"),
    (None, "alice", "alice"),
    ("s-1", "alice", "s-1"),  # the header wins over the body
    (None, 7, ""),  # a non-string user is ignored (it is the engine's business to reject it)
])
def test_session_key(header: str | None, user: object, expected: str) -> None:
    head = parse_head([(":method", "POST"), (":path", "/v1/chat/completions"),
                       *((("X-Session-Id", header),) if header else ())])
    body: dict[str, object] = {"model": "m", "messages": [{"content": "x"}]}
    if user is not None:
        body["user"] = user
    facts = parse_request(head, orjson.dumps(body))
    assert isinstance(facts, RequestFacts) and facts.session_id == expected


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    body = {"model": "m", "max_tokens": 100, "max_completion_tokens": 7, "messages": [{"content": "x"}]}
    facts = parse_request(CHAT, orjson.dumps(body))
    assert isinstance(facts, RequestFacts) and facts.max_tokens == 7


@pytest.mark.parametrize(("prompt", "chars", "ids", "parts"), [
    ("hello", 5, 0, ("hello",)),
    (["ab", "cde"], 5, 0, ("ab", "cde")),
    ([1, 2, 3], 0, 3, ()),
    ([[1, 2], [3]], 0, 3, ()),
])
def test_completion_prompt_forms(prompt: object, chars: int, ids: int, parts: tuple[str, ...]) -> None:
    facts = parse_request(COMPLETIONS, orjson.dumps({"model": "m", "prompt": prompt}))
    assert isinstance(facts, RequestFacts)
    assert (facts.prompt_chars, facts.prompt_token_ids, facts.stream, facts.max_tokens) == (chars, ids, False, None)
    assert facts.prompt_parts == parts


@pytest.mark.parametrize(("head", "body", "code", "param"), [
    (CHAT, b"", "missing_body", None),
    (CHAT, b"{not json", "invalid_json", None),
    (CHAT, b"[1, 2]", "invalid_json", None),
    (CHAT, b'"text"', "invalid_json", None),
    (CHAT, b'{"messages": [{"content": "x"}]}', "missing_model", "model"),
    (CHAT, b'{"model": 3, "messages": [{"content": "x"}]}', "invalid_type", "model"),
    (CHAT, b'{"model": "", "messages": [{"content": "x"}]}', "invalid_type", "model"),
    (CHAT, b'{"model": ["m"], "messages": [{"content": "x"}]}', "invalid_type", "model"),
    (CHAT, b'{"model": "m", "stream": "yes", "messages": [{"content": "x"}]}', "invalid_type", "stream"),
    (CHAT, b'{"model": "m", "stream": 1, "messages": [{"content": "x"}]}', "invalid_type", "stream"),
    (CHAT, b'{"model": "m", "max_tokens": "10", "messages": [{"content": "x"}]}', "invalid_type", "max_tokens"),
    (CHAT, b'{"model": "m", "max_tokens": 1.5, "messages": [{"content": "x"}]}', "invalid_type", "max_tokens"),
    (CHAT, b'{"model": "m", "max_tokens": true, "messages": [{"content": "x"}]}', "invalid_type", "max_tokens"),
    (CHAT, b'{"model": "m", "max_tokens": 0, "messages": [{"content": "x"}]}', "invalid_type", "max_tokens"),
    (CHAT, b'{"model": "m", "max_completion_tokens": -1, "messages": [{"content": "x"}]}', "invalid_type",
     "max_completion_tokens"),
    (CHAT, b'{"model": "m"}', "missing_messages", "messages"),
    (CHAT, b'{"model": "m", "messages": "hi"}', "invalid_type", "messages"),
    (CHAT, b'{"model": "m", "messages": []}', "invalid_type", "messages"),
    (CHAT, b'{"model": "m", "messages": ["hi"]}', "invalid_type", "messages.0"),
    (CHAT, b'{"model": "m", "messages": [{"content": 5}]}', "invalid_type", "messages.0.content"),
    (CHAT, b'{"model": "m", "messages": [{"content": ["x"]}]}', "invalid_type", "messages.0.content"),
    (COMPLETIONS, b'{"model": "m"}', "missing_prompt", "prompt"),
    (COMPLETIONS, b'{"model": "m", "prompt": 5}', "invalid_type", "prompt"),
    (COMPLETIONS, b'{"model": "m", "prompt": ["a", 1]}', "invalid_type", "prompt"),
    (COMPLETIONS, b'{"model": "m", "prompt": [[1, "a"]]}', "invalid_type", "prompt"),
])
def test_bad_bodies_are_400(head: RequestHead, body: bytes, code: str, param: str | None) -> None:
    error = parse_request(head, body)
    assert isinstance(error, ApiError)
    assert (error.status, error.type, error.code, error.param) == (400, "invalid_request_error", code, param)
    assert error.message
