"""Every model-addressed endpoint through real Envoy (``poolgate up``): a fleet of a chat, an embedding, a
reranker and a speech-to-text pool; each request lands on a worker of the model it names (checked per request
by the worker's own header), tenants' keys, rights and limits apply, unknown paths get OpenAI's 404, and with
extproc stopped the fail-open route still serves every endpoint."""

from __future__ import annotations

import io
import os
import signal
import time
import wave
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from extproc.tenancy import key_digest
from poolgate.kernel.routing import WORKER_HEADER
from tests.e2e.conftest import RunningStack, poolgate_up

pytestmark = pytest.mark.e2e

KEY, LIMITED_KEY = "pg-endpoints-key", "pg-endpoints-limited"
CONFIG = {
    "key_prefix": "e2e-endpoints",
    "controller": {"token": "e2e-token", "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
    "extproc": {"max_request_bytes": 4194304},
    "pools": [{"name": "chat", "model": "chat-model"}, {"name": "embed", "model": "embed-model", "task": "embed"},
              {"name": "rerank", "model": "rerank-model", "task": "score"},
              {"name": "speech", "model": "speech-model", "task": "transcription"}],
    "workers": [{"id": "chat-a", "pool": "chat"}, {"id": "embed-a", "pool": "embed"},
                {"id": "rerank-a", "pool": "rerank"}, {"id": "speech-a", "pool": "speech"}],
    "tenancy": {"require_api_key": True},
    "tenants": [{"name": "team", "api_key_sha256": [key_digest(KEY)]},
                {"name": "limited", "api_key_sha256": [key_digest(LIMITED_KEY)], "models": ["embed-model"],
                 "requests_per_minute": 2}],
    "catalogue": {"models": [{"name": "embedder", "versions": [{"name": "v1", "served_name": "embed-model"}]}]},
}


@pytest.fixture(scope="module")
def fleet(redis_server: object) -> Iterator[RunningStack]:
    """A stack of its own: pools of four kinds of model, tenants, and a test that stops extproc."""
    with poolgate_up(CONFIG, redis_server.url) as running:  # type: ignore[attr-defined]
        deadline = time.monotonic() + 60
        for model in ("chat-model", "embed-model", "rerank-model", "speech-model"):
            while post(running, "/tokenize", {"model": model, "prompt": "x"}).status_code != 200:
                assert time.monotonic() < deadline, f"no worker of {model} became routable"
                time.sleep(0.2)
        yield running


def root(fleet: RunningStack) -> str:
    return fleet.base_url.removesuffix("/v1")


def post(fleet: RunningStack, path: str, body: dict[str, Any], key: str = KEY) -> httpx.Response:
    return httpx.post(root(fleet) + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def sdk(fleet: RunningStack, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet.base_url, api_key=key, max_retries=0, timeout=30)


def wav(seconds: float) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16_000)
        out.writeframes(b"\0\0" * int(16_000 * seconds))
    return buffer.getvalue()


def test_embeddings_go_to_the_embedding_pool(fleet: RunningStack) -> None:
    with sdk(fleet) as client:
        for model in ("embed-model", "embedder"):  # its served name and its catalogue name
            raw = client.embeddings.with_raw_response.create(model=model, input=["the cat", "a dog"])
            assert raw.headers[WORKER_HEADER] == "embed-a"
            result = raw.parse()
            assert len(result.data) == 2 and len(result.data[0].embedding) == 1024
            assert result.model == model  # the public name comes back


def test_responses_api_plain_and_streamed_on_the_chat_pool(fleet: RunningStack) -> None:
    with sdk(fleet) as client:
        raw = client.responses.with_raw_response.create(model="chat-model", input="Say hi", max_output_tokens=8)
        assert raw.headers[WORKER_HEADER] == "chat-a"
        response = raw.parse()
        assert response.status == "incomplete" and response.usage is not None
        assert response.usage.output_tokens == 8 and response.output_text
        stream = client.responses.create(model="chat-model", stream=True, max_output_tokens=5,
                                         input=[{"role": "user", "content": "Say hi"}])
        assert stream.response.headers[WORKER_HEADER] == "chat-a"
        events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 5 and "".join(deltas) == events[-1].response.output_text  # type: ignore[union-attr]


@pytest.mark.parametrize(("path", "body", "worker"), [
    ("/v1/score", {"model": "rerank-model", "text_1": "red apples", "text_2": ["red apples", "blue sky"]},
     "rerank-a"),
    ("/score", {"model": "embed-model", "text_1": "red apples", "text_2": "red apples"}, "embed-a"),
    ("/rerank", {"model": "rerank-model", "query": "apples", "documents": ["sky", "apples"]}, "rerank-a"),
    ("/v2/rerank", {"model": "rerank-model", "query": "apples", "documents": ["sky", "apples"]}, "rerank-a"),
    ("/tokenize", {"model": "chat-model", "prompt": "Hello, world"}, "chat-a"),
    ("/tokenize", {"model": "speech-model", "prompt": "Hello"}, "speech-a"),
    ("/detokenize", {"model": "embed-model", "tokens": [300, 301]}, "embed-a"),
])
def test_each_endpoint_lands_on_a_worker_of_its_model(fleet: RunningStack, path: str, body: dict[str, Any],
                                                      worker: str) -> None:
    for _ in range(3):
        answer = post(fleet, path, body)
        assert (answer.status_code, answer.headers[WORKER_HEADER]) == (200, worker), answer.text


def test_rerank_orders_by_relevance(fleet: RunningStack) -> None:
    ranked = post(fleet, "/v2/rerank", {"model": "rerank-model", "query": "red apples",
                                        "documents": ["blue sky", "red apples"]}).json()
    assert [r["index"] for r in ranked["results"]] == [1, 0]


def test_audio_transcription_goes_to_the_speech_pool(fleet: RunningStack) -> None:
    with sdk(fleet) as client:
        raw = client.audio.transcriptions.with_raw_response.create(model="speech-model",
                                                                   file=("clip.wav", wav(2.0), "audio/wav"))
    assert raw.headers[WORKER_HEADER] == "speech-a"
    assert len(raw.parse().text.split()) == 6
    files = {"file": ("clip.wav", wav(1.0), "audio/wav")}
    translated = httpx.post(fleet.base_url + "/audio/translations", data={"model": "speech-model"}, files=files,
                            headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert (translated.status_code, translated.headers[WORKER_HEADER]) == (200, "speech-a")


def test_an_endpoint_the_model_does_not_serve_is_400_before_any_worker(fleet: RunningStack) -> None:
    with sdk(fleet) as client, pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model="chat-model", input="x")
    assert refused.value.code == "unsupported_endpoint"
    assert WORKER_HEADER not in refused.value.response.headers


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/assistants"), ("GET", "/v1/embeddings"),
                                              ("DELETE", "/v1/responses")])
def test_unknown_paths_get_openai_404(fleet: RunningStack, method: str, path: str) -> None:
    answer = httpx.request(method, root(fleet) + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert answer.status_code == 404 and answer.headers["content-type"].startswith("application/json")
    assert answer.json()["error"] == {"message": f"Invalid URL ({method} {path})", "type": "invalid_request_error",
                                      "param": None, "code": "unknown_url"}
    assert WORKER_HEADER not in answer.headers


def test_model_list_keeps_every_public_name(fleet: RunningStack) -> None:
    with sdk(fleet) as client:
        names = {model.id for model in client.models.list()}
    assert names == {"chat-model", "rerank-model", "speech-model", "embedder"}  # a served name behind a public one
    # stays hidden (catalogue.list_served_names)


def test_tenant_keys_rights_and_limits_apply(fleet: RunningStack) -> None:
    assert post(fleet, "/tokenize", {"model": "chat-model", "prompt": "x"}, key="wrong").status_code == 401
    assert post(fleet, "/tokenize", {"model": "chat-model", "prompt": "x"}, key=LIMITED_KEY).status_code == 403
    statuses = [post(fleet, "/v1/embeddings", {"model": "embed-model", "input": "x"}, key=LIMITED_KEY)
                for _ in range(4)]
    refused = [r for r in statuses if r.status_code == 429]
    assert [r.status_code for r in statuses[:2]] == [200, 200] and refused, [r.status_code for r in statuses]
    assert refused[0].json()["error"]["param"] == "requests_per_minute" and "retry-after" in refused[0].headers


def test_fail_open_serves_every_endpoint_with_extproc_stopped(fleet: RunningStack) -> None:
    """Last in this module: it stops extproc. The fail-open route retries another worker on 400/404 until one
    serves the model and its endpoint (4 workers, 4 attempts)."""
    extproc_pid = fleet.children()["extproc"]
    os.kill(extproc_pid, signal.SIGSTOP)
    try:
        calls = [("/v1/embeddings", {"model": "embed-model", "input": "x"}, "embed-a"),
                 ("/v1/responses", {"model": "chat-model", "input": "x", "max_output_tokens": 4}, "chat-a"),
                 ("/v2/rerank", {"model": "rerank-model", "query": "q", "documents": ["d"]}, "rerank-a"),
                 ("/tokenize", {"model": "speech-model", "prompt": "x"}, "speech-a")]
        for path, body, worker in calls:
            answer = post(fleet, path, body)
            assert (answer.status_code, answer.headers.get(WORKER_HEADER)) == (200, worker), (path, answer.text)
    finally:
        os.kill(extproc_pid, signal.SIGCONT)
