"""Hostile input to the request parser: whatever the headers and body, the answer is facts or an OpenAI-style
error value, never an exception (an exception on the request path becomes a 500 and a lost stream)."""

from __future__ import annotations

import orjson
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from extproc.endpoints import CHAT_PATH, COMPLETIONS_PATH
from extproc.errors import ApiError
from extproc.request import RequestFacts, RequestHead, parse_head
from poolgate.kernel.routing import ROUTING_HEADERS
from tests.unit.test_extproc_request import parse_request

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADS = (RequestHead("POST", CHAT_PATH, None), RequestHead("POST", COMPLETIONS_PATH, None))

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
                         st.floats(allow_nan=False), st.text(max_size=40))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)), max_leaves=30)
fields = st.sampled_from(["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream",
                          "stream_options", "user", "content", "text", "role"])
message = st.one_of(json_values, st.fixed_dictionaries({}, optional={"role": json_values, "content": st.one_of(
    st.text(max_size=50), st.lists(st.one_of(json_values, st.fixed_dictionaries({"text": json_values})),
                                   max_size=4), json_values)}))
bodies_shaped_like_requests = st.fixed_dictionaries({}, optional={
    "model": st.one_of(st.text(max_size=20), json_values),
    "messages": st.one_of(st.lists(message, max_size=6), json_values),
    "prompt": st.one_of(st.text(max_size=50), st.lists(st.text(max_size=10), max_size=4),
                        st.lists(st.integers(), max_size=6), st.lists(st.lists(st.integers(), max_size=4),
                                                                      max_size=3), json_values),
    "max_tokens": st.one_of(st.integers(), json_values),
    "max_completion_tokens": st.one_of(st.integers(), json_values),
    "stream": json_values,
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": json_values}), json_values),
    "user": json_values,
}).flatmap(lambda known: st.dictionaries(fields, json_values, max_size=3).map(lambda extra: {**extra, **known}))


def assert_outcome(outcome: object) -> None:
    if isinstance(outcome, ApiError):
        assert 400 <= outcome.status < 600
        error = orjson.loads(outcome.body())["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    else:
        assert isinstance(outcome, RequestFacts)
        assert outcome.model and outcome.prompt_chars >= 0 and outcome.prompt_token_ids >= 0
        assert outcome.max_tokens is None or outcome.max_tokens >= 1


@FAST
@given(st.sampled_from(HEADS), st.binary(max_size=2000))
@example(HEADS[0], b"\xff\xfe{\"model\": 1}")
@example(HEADS[0], b"[" * 5000 + b"]" * 5000)
@example(HEADS[0], b'{"model": "m", "messages": [{"content": "x"}], "max_tokens": 1e400}')
@example(HEADS[0], b'{"model": "m", "messages": [{"content": "x"}], "max_tokens": 99999999999999999999999}')
@example(HEADS[0], b'{"model": "\\ud800", "messages": [{"content": "x"}]}')
def test_any_bytes_give_facts_or_an_error(head: RequestHead, body: bytes) -> None:
    assert_outcome(parse_request(head, body))


@FAST
@given(st.sampled_from(HEADS), bodies_shaped_like_requests)
def test_any_json_request_gives_facts_or_an_error(head: RequestHead, data: dict[str, object]) -> None:
    try:
        body = orjson.dumps(data)
    except orjson.JSONEncodeError:  # e.g. an integer orjson itself cannot write; such a body never arrives
        return
    assert_outcome(parse_request(head, body))


def test_a_hundred_thousand_messages_are_measured_not_refused() -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}] * 100_000})
    facts = parse_request(HEADS[0], body)
    assert isinstance(facts, RequestFacts) and facts.message_count == 100_000


header_text = st.text(st.characters(codec="utf-8"), max_size=30)


@FAST
@given(st.lists(st.tuples(st.one_of(header_text, st.sampled_from([":method", ":path", "content-length",
                                                                   "x-tenant-id", *ROUTING_HEADERS])),
                          header_text), max_size=12),
       st.one_of(st.none(), st.just("x-tenant-id")), st.booleans())
def test_any_headers_give_a_head_and_routing_headers_are_always_caught(
        pairs: list[tuple[str, str]], tenant_header: str | None, trusted: bool) -> None:
    head = parse_head(pairs, tenant_header, trusted)
    sent = {key.lower() for key, _ in pairs}
    assert set(ROUTING_HEADERS) & sent <= set(head.client_routing_headers)
    if tenant_header and not trusted and tenant_header in sent:
        assert tenant_header in head.client_routing_headers and head.tenant_claim == ""


def test_unicode_digit_content_length_is_not_an_exception() -> None:
    head = parse_head([(":method", "POST"), (":path", CHAT_PATH), ("content-length", "²")])
    assert head.content_length is None
