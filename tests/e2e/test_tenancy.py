"""Tenants through real Envoy (``poolgate up`` with a tenants config): keys, forged headers, model rights,
quotas with Retry-After, usage reconciled from a real stream whose extra usage chunk the client never sees, and
the same usage in extproc's OpenTelemetry GenAI metrics for a tenant without a token quota."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from extproc.quota import WINDOW_S
from extproc.tenancy import key_digest
from poolgate.kernel.keys import QuotaKeys
from poolgate.procs import free_port
from tests.e2e.conftest import RunningStack, poolgate_up

pytestmark = pytest.mark.e2e

PREFIX = "e2e-tenancy"
KEYS = {"gold": "pg-gold-key", "bronze": "pg-bronze-key", "metered": "pg-metered-key"}
CONFIG = {
    "key_prefix": PREFIX,
    "controller": {"token": "e2e-token", "heartbeat_interval_s": 0.25, "heartbeat_ttl_s": 1.0},
    "extproc": {"max_request_bytes": 1048576},
    "pools": [{"name": "chat", "model": "chat-model"}, {"name": "vip", "model": "chat-model"},
              {"name": "code", "model": "code-model"}],
    "workers": [{"id": "chat-a", "pool": "chat"}, {"id": "vip-a", "pool": "vip"}, {"id": "code-a", "pool": "code"}],
    "tenancy": {"require_api_key": True, "tenant_header": "x-tenant-id"},
    "tenants": [
        {"name": "gold", "api_key_sha256": [key_digest(KEYS["gold"])], "priority": "high",
         "dedicated_pools": ["vip"]},
        {"name": "bronze", "api_key_sha256": [key_digest(KEYS["bronze"])], "priority": "low",
         "models": ["chat-model"], "requests_per_minute": 3},
        {"name": "metered", "api_key_sha256": [key_digest(KEYS["metered"])], "tokens_per_minute": 50_000},
    ],
}


@pytest.fixture(scope="module")
def tenancy_stack(redis_server: object) -> Iterator[RunningStack]:
    config = {**CONFIG, "observability": {"genai_metrics": True, "extproc_metrics_port": free_port()}}
    with poolgate_up(config, redis_server.url) as stack:  # type: ignore[attr-defined]
        # With keys required, READY means the router answers; wait until each pool serves a keyed request too.
        deadline = time.monotonic() + 60
        for key, model in ((KEYS["gold"], "chat-model"), (KEYS["metered"], "chat-model"),
                           (KEYS["metered"], "code-model")):
            while chat(stack, key, model).status_code != 200:
                assert time.monotonic() < deadline, "stack did not serve keyed requests"
                time.sleep(0.2)
        yield stack


def client(stack: RunningStack, key: str, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=30, **kwargs)  # type: ignore[arg-type]


def chat(stack: RunningStack, key: str, model: str = "chat-model", **headers: str) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {key}", **headers},
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_wrong_or_missing_key_is_401(tenancy_stack: RunningStack) -> None:
    with pytest.raises(openai.AuthenticationError):
        client(tenancy_stack, "pg-wrong").chat.completions.create(
            model="chat-model", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    response = httpx.get(f"{tenancy_stack.base_url}/models", timeout=30)
    assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


def test_forged_tenant_header_is_ignored(tenancy_stack: RunningStack) -> None:
    for forged in ({"x-tenant-id": "gold"}, {"x-poolgate-tenant": "gold"}):
        assert chat(tenancy_stack, "pg-wrong", **forged).status_code == 401
        answer = chat(tenancy_stack, KEYS["gold"], **forged)  # a real key with someone else's name: its own
        assert answer.status_code == 200
    workers = {chat(tenancy_stack, KEYS["metered"], **{"x-tenant-id": "gold"}).headers["x-poolgate-worker"]
               for _ in range(6)}
    assert workers == {"chat-a"}  # never the pool dedicated to gold


def test_dedicated_pool(tenancy_stack: RunningStack) -> None:
    workers = {chat(tenancy_stack, KEYS["gold"]).headers["x-poolgate-worker"] for _ in range(6)}
    assert workers == {"vip-a"}


def test_disallowed_model_is_403(tenancy_stack: RunningStack) -> None:
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client(tenancy_stack, KEYS["bronze"]).completions.create(model="code-model", prompt="x", max_tokens=1)
    assert caught.value.status_code == 403


def test_over_quota_is_429_with_retry_after(tenancy_stack: RunningStack) -> None:
    statuses = [chat(tenancy_stack, KEYS["bronze"]) for _ in range(5)]
    refused = [r for r in statuses if r.status_code == 429]
    assert refused and sum(r.status_code == 200 for r in statuses) <= 3
    error = refused[0].json()["error"]
    assert error["param"] == "requests_per_minute" and "requests_per_minute" in error["message"]
    assert 1 <= int(refused[0].headers["retry-after"]) <= 60


def test_stream_usage_is_charged_and_the_extra_chunk_hidden(tenancy_stack: RunningStack) -> None:
    if time.time() % WINDOW_S > WINDOW_S - 10:  # keep both streams and the check in one minute window
        time.sleep(WINDOW_S - time.time() % WINDOW_S + 0.1)
    api = client(tenancy_stack, KEYS["metered"])
    store = redis.Redis.from_url(tenancy_stack.redis_url)
    key = QuotaKeys(PREFIX).tokens("metered", int(time.time() // WINDOW_S))
    try:
        before = int(store.get(key) or 0)
        ask = {"model": "chat-model", "messages": [{"role": "user", "content": "count"}], "max_tokens": 20,
               "stream": True}
        chunks = list(api.chat.completions.create(**ask))  # type: ignore[call-overload]
        assert chunks and all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
        with_usage = list(api.chat.completions.create(**ask, stream_options={"include_usage": True}))
        usage = with_usage[-1].usage
        assert usage is not None  # a client that asked still gets it
        deadline = time.monotonic() + 5
        while int(store.get(key) or 0) - before != 2 * usage.total_tokens and time.monotonic() < deadline:
            time.sleep(0.05)
        # Reserved at admission: the prompt estimate + 20 each; after reconcile: exactly the real totals.
        assert int(store.get(key) or 0) - before == 2 * usage.total_tokens
    finally:
        store.close()


def genai_series(stack: RunningStack, name: str, **labels: str) -> float:
    """The sum of extproc's ``name`` samples for chat-model whose labels include ``labels``."""
    text = stack.extproc_metrics()
    wanted = {"gen_ai_request_model": "chat-model", **labels}
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and wanted.items() <= sample.labels.items())


def test_genai_metrics_count_a_streams_tokens_and_the_client_never_sees_the_usage_chunk(
        tenancy_stack: RunningStack) -> None:
    """gold has no token quota: the usage chunk is asked for, read and hidden for the GenAI metrics alone."""
    api = client(tenancy_stack, KEYS["gold"])
    ask = {"model": "chat-model", "messages": [{"role": "user", "content": "count to ten"}], "max_tokens": 12,
           "stream": True}

    def totals() -> tuple[float, ...]:
        return (genai_series(tenancy_stack, "gen_ai_client_token_usage_count", gen_ai_token_type="input"),
                genai_series(tenancy_stack, "gen_ai_client_token_usage_sum", gen_ai_token_type="input"),
                genai_series(tenancy_stack, "gen_ai_client_token_usage_sum", gen_ai_token_type="output"),
                genai_series(tenancy_stack, "gen_ai_server_time_to_first_token_seconds_count"),
                genai_series(tenancy_stack, "gen_ai_server_request_duration_seconds_count", error_type=""))

    def since(before: tuple[float, ...], expected: tuple[float, ...]) -> tuple[float, ...]:
        """The growth since ``before``, once it is ``expected`` or after 5 s: extproc records at the response's
        end of stream, which Envoy may pass on a moment after the client has read ``[DONE]``."""
        deadline = time.monotonic() + 5
        while (grown := tuple(now - then for then, now in zip(before, totals(), strict=True))) != expected:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return grown

    before = totals()
    with_usage = list(api.chat.completions.create(**ask, stream_options={"include_usage": True}))  # type: ignore[call-overload]
    usage = with_usage[-1].usage
    assert usage is not None  # a client that asked gets its chunk
    expected = (1, usage.prompt_tokens, usage.completion_tokens, 1, 1)
    assert since(before, expected) == expected

    before = totals()
    chunks = list(api.chat.completions.create(**ask))  # type: ignore[call-overload]
    assert chunks and all(c.usage is None for c in chunks) and all(c.choices for c in chunks)
    generated = sum(1 for c in chunks if c.choices[0].delta.content)
    expected = (1, usage.prompt_tokens, generated, 1, 1)
    assert since(before, expected) == expected
