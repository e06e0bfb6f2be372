"""Through real Envoy with the openai SDK: serving, per-model pools, errors, and untrusted routing headers."""

from __future__ import annotations

import re
import time
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from poolgate.kernel.routing import pool_clusters, worker_cluster
from tests.e2e.conftest import E2E_CONFIG, RunningStack, poolgate_up

pytestmark = pytest.mark.e2e


def client(stack: RunningStack, **kwargs: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30, **kwargs)  # type: ignore[arg-type]


def test_chat_completion_names_its_worker(stack: RunningStack) -> None:
    raw = client(stack).chat.completions.with_raw_response.create(
        model="chat-model", messages=[{"role": "user", "content": "Say hello"}], max_tokens=8)
    completion = raw.parse()
    assert raw.headers["x-poolgate-worker"] in {"chat-a", "chat-b"}
    assert completion.model == "chat-model"
    assert completion.choices[0].message.content
    assert completion.usage is not None and completion.usage.completion_tokens <= 8


def test_access_log_names_pool_worker_and_request(stack: RunningStack) -> None:
    raw = client(stack).chat.completions.with_raw_response.create(
        model="chat-model", messages=[{"role": "user", "content": "Log me"}], max_tokens=4)
    worker, request_id = raw.headers["x-poolgate-worker"], raw.headers["x-request-id"]
    log = stack.run_dir / "envoy-access.log"
    deadline = time.monotonic() + 10  # Envoy flushes its access log about once a second
    while not (log.exists() and request_id in log.read_text()):
        assert time.monotonic() < deadline, "no access log line for the request"
        time.sleep(0.1)
    line = next(line for line in log.read_text().splitlines() if request_id in line)
    assert "cluster=pool-chat" in line and f"worker={worker}" in line and " 200 " in line, line


def test_gateway_genai_metrics_without_tenants(stack: RunningStack) -> None:
    """No tenant reads usage here: the GenAI metrics alone make Envoy pass the streamed response to extproc."""

    def series(name: str) -> float:
        text = stack.extproc_metrics()
        return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                   if sample.name == name and sample.labels.get("gen_ai_request_model") == "code-model")

    names = ("gen_ai_server_time_to_first_token_seconds_count", "gen_ai_server_time_per_output_token_seconds_count")
    before = [series(name) for name in names]
    chunks = list(client(stack).completions.create(model="code-model", prompt="def f(x):", max_tokens=6,
                                                     stream=True))
    assert chunks and all(chunk.usage is None for chunk in chunks)  # the injected usage chunk stays hidden
    deadline = time.monotonic() + 5  # recorded at the response's end of stream, a moment after [DONE] at most
    while (grown := [series(name) - then for name, then in zip(names, before, strict=True)]) != [1, 1]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert grown == [1, 1]


def test_completion_and_streaming(stack: RunningStack) -> None:
    api = client(stack)
    completion = api.completions.create(model="code-model", prompt="def add(a, b):", max_tokens=5)
    assert completion.choices[0].finish_reason in {"length", "stop"}
    assert completion.usage is not None and completion.usage.prompt_tokens > 0
    chunks = list(api.chat.completions.create(
        model="chat-model", messages=[{"role": "user", "content": "stream please"}], max_tokens=12, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == sum(1 for c in chunks if c.choices and
                                                                 c.choices[0].delta.content)


def test_each_model_stays_in_its_own_pool(stack: RunningStack) -> None:
    api = client(stack)
    seen: dict[str, set[str]] = {"chat-model": set(), "code-model": set()}
    for index in range(24):
        model = "chat-model" if index % 2 else "code-model"
        raw = api.completions.with_raw_response.create(model=model, prompt=f"request {index}", max_tokens=2)
        seen[model].add(raw.headers["x-poolgate-worker"])
    assert seen["chat-model"] and seen["chat-model"] <= {"chat-a", "chat-b"}
    assert seen["code-model"] and seen["code-model"] <= {"code-a", "code-b"}
    # Least in-flight spreads sequential traffic over both workers of a pool.
    assert len(seen["chat-model"]) == 2 and len(seen["code-model"]) == 2


def test_models_endpoint_lists_every_served_model(stack: RunningStack) -> None:
    ids = {m.id for m in client(stack).models.list()}
    assert {"chat-model", "code-model"} <= ids


@pytest.mark.parametrize(
    ("body", "status", "code_word"),
    [
        (b"{not json", 400, "json"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "model"),
        (b'{"model": 7, "messages": []}', 400, "model"),
        (b'{"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}', 404, "no-such-model"),
    ],
)
def test_bad_requests_get_json_errors(stack: RunningStack, body: bytes, status: int, code_word: str) -> None:
    response = httpx.post(f"{stack.base_url}/chat/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert code_word in error["message"].lower()
    assert_still_serving(stack)


def test_oversized_body_gets_413_json(stack: RunningStack) -> None:
    huge = "x" * (int(stack.config["extproc"]["max_request_bytes"]) + 1000)  # type: ignore[index]
    response = httpx.post(f"{stack.base_url}/chat/completions", timeout=30,
                          json={"model": "chat-model", "messages": [{"role": "user", "content": huge}]})
    assert response.status_code == 413
    assert "error" in response.json()
    assert_still_serving(stack)


def assert_still_serving(stack: RunningStack) -> None:
    reply = client(stack).chat.completions.create(model="chat-model", messages=[{"role": "user", "content": "ok?"}],
                                                  max_tokens=2)
    assert reply.choices


def test_client_routing_headers_cannot_choose_pool_or_worker(stack: RunningStack) -> None:
    workers = {w: stack.address(w) for w in ("code-a", "chat-a")}
    forged = {
        "x-poolgate-cluster": "pool-code",
        "x-gateway-destination-endpoint": workers["code-a"],
        "x-poolgate-pool": "code",
    }
    api = client(stack, default_headers=forged)
    for _ in range(10):
        raw = api.completions.with_raw_response.create(model="chat-model", prompt="hi", max_tokens=1)
        assert raw.headers["x-poolgate-worker"] in {"chat-a", "chat-b"}


SHARDED_CONFIG = {**E2E_CONFIG, "key_prefix": "e2e-shards", "scheduling": {"debug_header": True},
                  "pools": [{"name": "chat", "model": "chat-model", "endpoint_shards": 2}],
                  "workers": [{"id": worker_id, "pool": "chat"} for worker_id in ("chat-a", "chat-b", "chat-d")]}
"""chat-a and chat-b hash to the first shard, chat-d to the second."""

_LOG_LINE = re.compile(r"cluster=(\S+) host=\S+ worker=(\S+) .* id=(\S+) .* decision=\"worker=(\S+) ")


def test_a_sharded_pool_serves_each_request_on_the_worker_extproc_picked(redis_server: object) -> None:
    """A pool split over two Envoy clusters: each cluster holds the workers its hash names, and every request
    is served by the very worker extproc picked (a request sent to the wrong shard would be served by another
    worker of that shard), on both shards."""
    with poolgate_up(SHARDED_CONFIG, redis_server.url) as stack:  # type: ignore[attr-defined]
        clusters = pool_clusters("chat", 2)
        workers = [worker["id"] for worker in SHARDED_CONFIG["workers"]]  # type: ignore[index]

        def sharded_as_hashed() -> bool:
            if not all(stack.record(w).get("state") == "Ready" for w in workers):
                return False  # up is ready once the pool serves, before every worker is
            return all(set(stack.envoy_hosts(c)) == {stack.address(w) for w in workers
                                                     if worker_cluster("chat", w, 2) == c} for c in clusters)

        deadline = time.monotonic() + 60
        while not sharded_as_hashed():
            assert time.monotonic() < deadline, {c: stack.envoy_hosts(c) for c in clusters}
            time.sleep(0.2)
        openai_client = client(stack)
        request_ids = set()
        for _ in range(24):  # prompts of their own: one prompt would follow prefix affinity to one worker
            raw = openai_client.chat.completions.with_raw_response.create(
                model="chat-model", messages=[{"role": "user", "content": f"question {uuid.uuid4()}"}], max_tokens=2)
            request_ids.add(raw.headers["x-request-id"])
        log = stack.run_dir / "envoy-access.log"
        deadline = time.monotonic() + 15  # Envoy flushes its access log about once a second
        while True:
            lines = {m.group(3): m for m in map(_LOG_LINE.search, log.read_text().splitlines() if log.exists() else [])
                     if m is not None and m.group(3) in request_ids}
            if len(lines) == len(request_ids):
                break
            assert time.monotonic() < deadline, f"{len(lines)} of {len(request_ids)} requests in the access log"
            time.sleep(0.2)
        served = set()
        for cluster, worker, _, picked in (m.groups() for m in lines.values()):
            assert worker == picked, f"extproc picked {picked}, {worker} served it"
            assert cluster == worker_cluster("chat", worker, 2)
            served.add(cluster)
        assert served == set(clusters)
