"""The endpoint table and each family's parser: the model they route by, what they cost, and 400s/404s."""

from __future__ import annotations

import io
import wave
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.endpoints import ENDPOINTS, OUTSIDE_V1, path_fate
from extproc.endpoints.multipart import form_data, parse_form
from extproc.errors import ApiError, unknown_path
from extproc.request import RequestFacts, RequestHead, facts_from_data, load_body
from extproc.scheduling.estimate import RequestProfiler
from poolgate.kernel.config import SchedulingSettings

PROFILER = RequestProfiler(SchedulingSettings(default_output_tokens=256, chars_per_token=4.0))


def head(path: str, method: str = "POST", content_type: str = "application/json") -> RequestHead:
    return RequestHead(method, path, None, content_type=content_type)


def parse(path: str, body: dict[str, Any] | bytes, content_type: str = "application/json") -> RequestFacts | ApiError:
    """As the resolve stage reads a body: JSON, or a form's fields."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    if ENDPOINTS[path].form:
        parts = parse_form(raw, content_type)
        data = parts if isinstance(parts, ApiError) else form_data(parts)
    else:
        data = load_body(raw)
    return data if isinstance(data, ApiError) else facts_from_data(head(path, content_type=content_type), data)


def routed(path: str, body: dict[str, Any] | bytes, content_type: str = "application/json") -> RequestFacts:
    facts = parse(path, body, content_type)
    assert isinstance(facts, RequestFacts), facts
    return facts


@pytest.mark.parametrize(("method", "path", "kind"), [
    ("POST", "/v1/chat/completions", "routed"), ("POST", "/v1/responses", "routed"),
    ("POST", "/tokenize", "routed"), ("POST", "/v2/rerank", "routed"), ("POST", "/score", "routed"),
    ("POST", "/v1/audio/translations", "routed"), ("GET", "/v1/models", "model_list"),
    ("GET", "/v1/embeddings", "unknown"), ("POST", "/v1/models", "unknown"), ("POST", "/v1/assistants", "unknown"),
    ("DELETE", "/v1/responses", "unknown"), ("GET", "/tokenize", "unknown"), ("POST", "/v1", "unknown"),
    ("GET", "/health", "passthrough"), ("GET", "/metrics", "passthrough"), ("POST", "/v1x", "passthrough"),
])
def test_every_path_has_one_fate(method: str, path: str, kind: str) -> None:
    assert path_fate(method, path) == kind


def test_unknown_paths_get_openai_404() -> None:
    error = unknown_path("POST", "/v1/assistants")
    assert (error.status, error.type, error.code) == (404, "invalid_request_error", "unknown_url")
    assert orjson.loads(error.body())["error"]["message"] == "Invalid URL (POST /v1/assistants)"


@pytest.mark.parametrize(("path", "body", "model"), [
    ("/v1/responses", {"model": "m", "input": "hi"}, "m"),
    ("/v1/embeddings", {"model": "bge", "input": ["a", "b"]}, "bge"),
    ("/v1/score", {"model": "rr", "text_1": "q", "text_2": ["a", "b"]}, "rr"),
    ("/rerank", {"model": "rr", "query": "q", "documents": ["a"]}, "rr"),
    ("/tokenize", {"model": "m", "prompt": "x"}, "m"),
    ("/detokenize", {"model": "m", "tokens": [1, 2]}, "m"),
])
def test_each_family_routes_by_its_model(path: str, body: dict[str, Any], model: str) -> None:
    assert routed(path, body).model == model


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/responses", {"input": "hi"}, "model"),
    ("/v1/responses", {"model": "m"}, "input"),
    ("/v1/responses", {"model": "m", "input": [3]}, "input.0"),
    ("/v1/responses", {"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ("/v1/responses", {"model": "m", "input": "x", "stream": "yes"}, "stream"),
    ("/v1/embeddings", {"model": "m"}, "input"),
    ("/v1/embeddings", {"model": "m", "input": [1, "a"]}, "input"),
    ("/v1/embeddings", {"model": 5, "input": "a"}, "model"),
    ("/score", {"model": "m", "text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/score", {"model": "m", "text_1": "a"}, "text_2"),
    ("/v2/rerank", {"model": "m", "query": "q", "documents": [1]}, "documents"),
    ("/tokenize", {"prompt": "x"}, "model"),
    ("/tokenize", {"model": "m"}, "prompt"),
    ("/detokenize", {"model": "m", "tokens": ["a"]}, "tokens"),
])
def test_bad_bodies_are_400_naming_the_field(path: str, body: dict[str, Any], param: str) -> None:
    error = parse(path, body)
    assert isinstance(error, ApiError) and (error.status, error.param) == (400, param)


@pytest.mark.parametrize("raw", [b"", b"[1]", b"{not json"])
def test_non_objects_are_400(raw: bytes) -> None:
    error = parse("/v1/embeddings", raw)
    assert isinstance(error, ApiError) and error.status == 400


def test_responses_items_count_like_chat_messages() -> None:
    facts = routed("/v1/responses", {"model": "m", "instructions": "be brief", "max_output_tokens": 50, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "abcd" * 10}]},
        {"type": "function_call", "name": "f", "arguments": '{"x":1}', "call_id": "c"},
        {"type": "function_call_output", "call_id": "c", "output": "done"},
        {"type": "input_image", "image_url": "http://x"},
    ]})
    assert facts.message_count == 5 and facts.prompt_parts == ("be brief", "abcd" * 10, "f", '{"x":1}', "done")
    request = PROFILER.profile(facts)
    chars = len("be brief") + 40 + 1 + 7 + 4
    assert request.prompt_tokens == -(-chars // 4) + 5 * 4 + 4
    assert request.output_tokens == 50


def test_responses_stream_carries_its_usage_and_session_hint() -> None:
    facts = routed("/v1/responses", {"model": "m", "input": "x", "stream": True, "user": "conv-7"})
    assert facts.stream and facts.include_usage and facts.session_id == "conv-7"
    assert not routed("/v1/responses", {"model": "m", "input": "x"}).include_usage


def test_embeddings_are_prefill_only_and_fit_by_their_longest_input() -> None:
    facts = routed("/v1/embeddings", {"model": "bge", "input": ["a" * 4000] * 10})
    request = PROFILER.profile(facts)
    assert request.prompt_tokens == 10_000 and request.output_tokens == 0
    assert request.min_prompt_tokens == 4000 // 8  # each input is its own sequence
    ids = PROFILER.profile(routed("/v1/embeddings", {"model": "bge", "input": [[1, 2, 3], [4] * 9]}))
    assert (ids.prompt_tokens, ids.min_prompt_tokens, ids.output_tokens) == (12, 9, 0)


@given(st.text(max_size=200), st.lists(st.text(max_size=200), min_size=1, max_size=8))
def test_rerank_costs_each_pair_and_no_decode(query: str, documents: list[str]) -> None:
    request = PROFILER.profile(routed("/v2/rerank", {"model": "rr", "query": query, "documents": documents}))
    assert request.output_tokens == 0
    assert request.prompt_tokens == -(-sum(len(query) + len(d) for d in documents) // 4)
    assert request.min_prompt_tokens == max(len(query) + len(d) for d in documents) // 8
    assert request.task_class in ("short_chat", "long_context")


@pytest.mark.parametrize(("names", "pairs"), [(("text_1", "text_2"), 3), (("queries", "documents"), 3),
                                              (("data_1", "data_2"), 3)])
def test_score_accepts_every_spelling(names: tuple[str, str], pairs: int) -> None:
    facts = routed("/score", {"model": "rr", names[0]: "q", names[1]: ["a", "b", "c"]})
    assert len(facts.prompt_parts) == pairs and facts.prompt_parts[0] == "qa"


def test_tokenize_is_near_free() -> None:
    request = PROFILER.profile(routed("/tokenize", {"model": "m", "prompt": "x" * 100_000}))
    assert (request.prompt_tokens, request.min_prompt_tokens, request.output_tokens) == (0, 0, 0)


def wav(seconds: float) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(b"\0\0" * int(16_000 * seconds))
    return buffer.getvalue()


def audio_form(fields: dict[str, str], audio: bytes | None) -> bytes:
    chunks = [f'--B\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()]
    if audio is not None:
        chunks.append(b'--B\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
                      b"Content-Type: audio/wav\r\n\r\n" + audio + b"\r\n")
    return b"".join(chunks) + b"--B--\r\n"


def test_audio_model_is_a_form_field_and_costs_follow_the_clip() -> None:
    body = audio_form({"model": "whisper", "stream": "true"}, wav(65.0))
    facts = routed("/v1/audio/transcriptions", body, 'multipart/form-data; boundary="B"')
    assert facts.model == "whisper" and facts.stream
    request = PROFILER.profile(facts)
    assert request.prompt_tokens == 3 * 1504 and request.output_tokens == 90 + 90 + 15
    assert request.min_prompt_tokens == 4


@pytest.mark.parametrize(("fields", "audio", "content_type", "param"), [
    ({}, b"RIFF", 'multipart/form-data; boundary="B"', "model"),
    ({"model": "w"}, None, 'multipart/form-data; boundary="B"', "file"),
    ({"model": "w"}, b"x", "application/json", None),
])
def test_bad_audio_forms_are_400(fields: dict[str, str], audio: bytes | None, content_type: str,
                                 param: str | None) -> None:
    error = parse("/v1/audio/translations", audio_form(fields, audio), content_type)
    assert isinstance(error, ApiError) and (error.status, error.param) == (400, param)


def test_chat_and_completions_keep_their_parser() -> None:
    chat = routed("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.cost is None and chat.message_count == 1
    assert ENDPOINTS["/v1/embeddings"].pool_tasks == {"embed"}
    assert OUTSIDE_V1 == ("/detokenize", "/rerank", "/score", "/tokenize", "/v2/rerank")
