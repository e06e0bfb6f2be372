"""What poolgate relies on from a vLLM worker's HTTP API, held against the simulated worker and a real vLLM.

Each test states one fact some part of poolgate reads: the probe (``/health``, ``/v1/models``), extproc's usage
reconcile and response rewriting (the OpenAI shapes, streamed chunks and the usage chunk), the agent (the
``/metrics`` names and labels), the controller's worker key (what it protects), tokenisation (``/tokenize``) and
the error shapes a client sees when a worker refuses. Where the two engines differ on purpose the test says so;
the rest of the differences are listed in ``simworker/presets.py``.
"""

from __future__ import annotations

import json

import httpx
import pytest

from agent.vllm_metrics import parse_engine_metrics
from tests.conformance.conftest import BLOCK_SIZE, Engine

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something short."}]


def _usage_ok(usage: dict[str, int], max_tokens: int) -> None:
    assert usage["prompt_tokens"] > 0
    assert 0 < usage["completion_tokens"] <= max_tokens
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def _sse(response: httpx.Response) -> list[dict[str, object]]:
    """The JSON chunks of an SSE body, checking every event is a ``data:`` line and the last is ``[DONE]``."""
    events = [line for line in response.text.split("\n\n") if line.strip()]
    assert all(event.startswith("data: ") for event in events), events[:3]
    assert events[-1] == "data: [DONE]"
    return [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


def test_health_answers_200_without_the_key(engine: Engine) -> None:
    assert httpx.get(f"{engine.url}/health", timeout=5).status_code == 200


def test_models_lists_the_served_name_and_its_context_length(engine: Engine) -> None:
    body = engine.get("/v1/models").json()
    assert body["object"] == "list"
    [model] = body["data"]
    assert model["id"] == engine.model and model["object"] == "model"
    assert model["max_model_len"] == engine.max_model_len
    assert model["owned_by"] == "vllm"


@pytest.mark.parametrize("path", ["/v1/models", "/v1/chat/completions", "/v1/completions"])
def test_the_key_protects_the_openai_paths(engine: Engine, path: str) -> None:
    """The controller gives workers a key (``VLLM_API_KEY``) and Envoy adds it: without it, ``/v1/*`` is 401."""
    body = {"model": engine.model, "prompt": "x", "messages": CHAT, "max_tokens": 1}
    answer = httpx.get(f"{engine.url}{path}", timeout=10) if path == "/v1/models" else \
        httpx.post(f"{engine.url}{path}", json=body, timeout=10)
    assert answer.status_code == 401
    wrong = httpx.get(f"{engine.url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert wrong.status_code == 401


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_the_key_leaves_health_and_metrics_open(engine: Engine, path: str) -> None:
    """The health probe and the agent's scrape carry no key; vLLM leaves these paths open."""
    assert httpx.get(f"{engine.url}{path}", timeout=10).status_code == 200


def test_tokenize_is_open_without_the_key(engine: Engine) -> None:
    answer = httpx.post(f"{engine.url}/tokenize", json={"model": engine.model, "prompt": "hello"}, timeout=10)
    assert answer.status_code == 200


def test_chat_completion_shape_and_usage(engine: Engine) -> None:
    body = engine.post("/v1/chat/completions", {"model": engine.model, "messages": CHAT, "max_tokens": 8}).json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == engine.model
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    _usage_ok(body["usage"], 8)


def test_completion_shape_and_usage(engine: Engine) -> None:
    body = engine.post("/v1/completions", {"model": engine.model, "prompt": "Once upon a time",
                                           "max_tokens": 6}).json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == engine.model
    [choice] = body["choices"]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("stop", "length")
    _usage_ok(body["usage"], 6)


def test_completion_takes_token_ids(engine: Engine) -> None:
    body = engine.post("/v1/completions", {"model": engine.model, "prompt": [11, 12, 13, 14, 15],
                                           "max_tokens": 3}).json()
    assert body["usage"]["prompt_tokens"] == 5
    _usage_ok(body["usage"], 3)


def test_ignore_eos_runs_to_max_tokens(engine: Engine) -> None:
    """Benchmarks ask for an exact length this way (vLLM's extra sampling parameter)."""
    body = engine.post("/v1/completions", {"model": engine.model, "prompt": "count", "max_tokens": 12,
                                           "ignore_eos": True}).json()
    assert body["usage"]["completion_tokens"] == 12
    assert body["choices"][0]["finish_reason"] == "length"


def test_streamed_chat_chunks_and_usage_chunk(engine: Engine) -> None:
    """extproc reads usage from the last chunk (``stream_options.include_usage``) and renames ``model`` in every
    chunk: each is a ``chat.completion.chunk`` with one id; the first delta names the role; one chunk carries
    the finish reason; the usage chunk comes last, with no choices."""
    answer = engine.post("/v1/chat/completions", {"model": engine.model, "messages": CHAT, "max_tokens": 6,
                                                  "stream": True, "stream_options": {"include_usage": True}})
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(answer)
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert {chunk["model"] for chunk in chunks} == {engine.model}
    first = chunks[0]["choices"][0]  # type: ignore[index]
    assert first["delta"]["role"] == "assistant"
    finishing = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]  # type: ignore[index]
    assert len(finishing) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    _usage_ok(usage_chunk["usage"], 6)  # type: ignore[arg-type]
    assert all(not c.get("usage") for c in chunks[:-1])


def test_stream_without_include_usage_has_no_usage(engine: Engine) -> None:
    """extproc asks for usage itself when it needs it: a stream that did not ask has none."""
    chunks = _sse(engine.post("/v1/chat/completions", {"model": engine.model, "messages": CHAT, "max_tokens": 4,
                                                       "stream": True}))
    assert all(not chunk.get("usage") for chunk in chunks)


def test_streamed_completion_chunks(engine: Engine) -> None:
    chunks = _sse(engine.post("/v1/completions", {"model": engine.model, "prompt": "abc", "max_tokens": 5,
                                                  "stream": True, "stream_options": {"include_usage": True}}))
    assert {chunk["object"] for chunk in chunks} == {"text_completion"}
    assert chunks[-1]["choices"] == []
    _usage_ok(chunks[-1]["usage"], 5)  # type: ignore[arg-type]


def test_tokenize_counts_a_prompt_and_a_chat(engine: Engine) -> None:
    prompt = engine.post("/tokenize", {"model": engine.model, "prompt": "The quick brown fox"}).json()
    assert prompt["count"] == len(prompt["tokens"]) > 0
    assert prompt["max_model_len"] == engine.max_model_len
    chat = engine.post("/tokenize", {"model": engine.model, "messages": CHAT,
                                     "add_generation_prompt": True}).json()
    assert chat["count"] == len(chat["tokens"]) > prompt["count"]


def test_tokenize_count_is_the_prompt_tokens_a_chat_is_billed(engine: Engine) -> None:
    """What ``/tokenize`` says a chat is, the engine bills as its prompt: the count extproc's estimate aims at."""
    counted = engine.post("/tokenize", {"model": engine.model, "messages": CHAT,
                                        "add_generation_prompt": True}).json()["count"]
    billed = engine.post("/v1/chat/completions", {"model": engine.model, "messages": CHAT,
                                                  "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert billed == counted


def _error(answer: httpx.Response, status: int) -> dict[str, object]:
    """vLLM's error shape, what a client sees through poolgate: ``{"error": {message, type, code}}``."""
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["code"] == status
    return error  # type: ignore[no-any-return]


def test_unknown_model_is_404_in_openai_shape(engine: Engine) -> None:
    answer = engine.post("/v1/chat/completions", {"model": "no-such-model", "messages": CHAT, "max_tokens": 1})
    assert _error(answer, 404)["type"] == "NotFoundError"


def test_prompt_over_the_context_is_400(engine: Engine) -> None:
    """poolgate refuses such a prompt itself when it can count it; when it cannot, the engine's 400 passes."""
    too_long = list(range(10, 10 + engine.max_model_len))
    answer = engine.post("/v1/completions", {"model": engine.model, "prompt": too_long, "max_tokens": 16})
    assert _error(answer, 400)["type"] == "BadRequestError"


def test_max_tokens_past_the_context_is_400(engine: Engine) -> None:
    answer = engine.post("/v1/completions", {"model": engine.model, "prompt": "hi",
                                             "max_tokens": engine.max_model_len + 1})
    _error(answer, 400)


def test_a_body_without_messages_is_400(engine: Engine) -> None:
    _error(engine.post("/v1/chat/completions", {"model": engine.model, "max_tokens": 1}), 400)


def test_metrics_carry_what_the_agent_reads(engine: Engine) -> None:
    """The agent's parser finds every fact routing uses on the page, under the served model's name."""
    engine.post("/v1/completions", {"model": engine.model, "prompt": "warm up the counters", "max_tokens": 2})
    page = httpx.get(f"{engine.url}/metrics", timeout=10).text
    facts = parse_engine_metrics(page, engine.model)
    assert facts.running is not None and facts.waiting is not None
    assert facts.kv_usage is not None and 0 <= facts.kv_usage <= 1
    assert facts.kv_block_size == BLOCK_SIZE
    assert facts.num_gpu_blocks is not None and facts.num_gpu_blocks > 0
    assert facts.preemptions_total is not None
    assert facts.prompt_tokens_total is not None and facts.prompt_tokens_total > 0
    assert facts.generation_tokens_total is not None and facts.generation_tokens_total > 0
    assert facts.ttft_count is not None and facts.ttft_count > 0 and facts.ttft_sum_s is not None
    assert facts.prefill_time_sum_s is not None
    assert f'model_name="{engine.model}"' in page and 'engine="0"' in page


@pytest.mark.parametrize("name", ["vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                                  "vllm:num_requests_waiting", "vllm:cache_config_info",
                                  "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"])
def test_metrics_names(engine: Engine, name: str) -> None:
    page = httpx.get(f"{engine.url}/metrics", timeout=10).text
    assert any(line.startswith(name) for line in page.splitlines()), name


def test_reset_prefix_cache_is_served(engine: Engine) -> None:
    """vLLM serves it in dev mode only (``VLLM_SERVER_DEV_MODE=1``); the simulator always does."""
    assert engine.post("/reset_prefix_cache", {}).status_code == 200



def test_chat_takes_multi_part_content_and_max_completion_tokens(engine: Engine) -> None:
    """Message content as a list of text parts, and OpenAI's newer name for the output cap."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "first part"},
                                             {"type": "text", "text": "second part"}]}]
    body = engine.post("/v1/chat/completions", {"model": engine.model, "messages": messages,
                                                "max_completion_tokens": 3}).json()
    _usage_ok(body["usage"], 3)


def test_stream_options_without_stream_is_400(engine: Engine) -> None:
    answer = engine.post("/v1/chat/completions", {"model": engine.model, "messages": CHAT, "max_tokens": 2,
                                                  "stream_options": {"include_usage": True}})
    _error(answer, 400)


def test_detokenize_turns_ids_back_into_text(engine: Engine) -> None:
    tokens = engine.post("/tokenize", {"model": engine.model, "prompt": "hello world",
                                       "add_special_tokens": False}).json()["tokens"]
    answer = engine.post("/detokenize", {"model": engine.model, "tokens": tokens})
    assert answer.status_code == 200 and isinstance(answer.json()["prompt"], str)


def test_responses_api_shape_and_usage(engine: Engine) -> None:
    """extproc reads the Responses API's usage as ``input_tokens``/``output_tokens``."""
    body = engine.post("/v1/responses", {"model": engine.model, "input": "Say hi.", "max_output_tokens": 6}).json()
    assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
    assert body["model"] == engine.model
    messages = [item for item in body["output"] if item["type"] == "message"]
    assert messages and messages[0]["content"][0]["type"] == "output_text"
    usage = body["usage"]
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 6
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_streamed_responses_end_with_usage_in_response_completed(engine: Engine) -> None:
    answer = engine.post("/v1/responses", {"model": engine.model, "input": "Say hi.", "max_output_tokens": 6,
                                           "stream": True})
    assert answer.status_code == 200
    events = [json.loads(line.removeprefix("data: ")) for line in answer.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    kinds = [event["type"] for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert "response.output_text.delta" in kinds
    usage = events[-1]["response"]["usage"]
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 6
