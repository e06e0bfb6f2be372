"""A simulated worker over real HTTP, driven by the openai SDK and raw aiohttp requests."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from poolgate.kernel.routing import WORKER_HEADER
from simworker.faults import FaultSettings
from simworker.worker import SimWorker
from tests.conftest import StartSimWorker

MODEL = "sim-llama-3-8b"


def base_url(worker: SimWorker) -> str:
    return f"http://127.0.0.1:{worker.spec.port}"


def client(worker: SimWorker) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url(worker) + "/v1", api_key="unused", max_retries=0)


async def metric_samples(session: aiohttp.ClientSession, worker: SimWorker) -> dict[str, float]:
    async with session.get(base_url(worker) + "/metrics") as response:
        text = await response.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "finished_reason" in sample.labels:
                key += f"{{{sample.labels['finished_reason']}}}"
            samples.setdefault(key, sample.value)
    return samples


async def test_models_card_matches_vllm(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(max_model_len=4096)
    async with aiohttp.ClientSession() as session, session.get(base_url(worker) + "/v1/models") as response:
        body = await response.json()
        assert response.headers[WORKER_HEADER] == worker.spec.worker_id
    card = body["data"][0]
    assert body["object"] == "list"
    assert {k: card[k] for k in ("id", "object", "owned_by", "parent", "max_model_len")} == {
        "id": MODEL, "object": "model", "owned_by": "vllm", "parent": None, "max_model_len": 4096}
    async with client(worker) as sdk:
        models = await sdk.models.list()
    assert [model.id for model in models.data] == [MODEL]


async def test_chat_completion_counts_tokens_and_names_the_worker(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker()
    async with client(worker) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello there!"}], max_tokens=7)
        completion = raw.parse()
    assert raw.headers[WORKER_HEADER] == worker.spec.worker_id
    # <|start|> user <|sep|> Hello there ! <|end|> + <|start|> assistan t <|sep|>
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens,
            completion.usage.total_tokens) == (11, 7, 18)
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert len((choice.message.content or "").split()) == 7


async def test_completion_without_max_tokens_stops_by_itself(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(time_scale=200.0)
    async with client(worker) as sdk:
        first = await sdk.completions.create(model=MODEL, prompt="Tell me a story about routers.")
        again = await sdk.completions.create(model=MODEL, prompt="Tell me a story about routers.")
    assert first.choices[0].finish_reason == "stop"
    assert first.usage is not None and 1 <= first.usage.completion_tokens <= 1024
    assert first.choices[0].text == again.choices[0].text  # deterministic per prompt


async def test_ignore_eos_runs_to_max_tokens(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(time_scale=200.0)
    async with client(worker) as sdk:
        completion = await sdk.completions.create(model=MODEL, prompt="x", max_tokens=600,
                                                  extra_body={"ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 600


async def test_chat_stream_with_usage(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker()
    async with client(worker) as sdk:
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
            max_tokens=5, stream=True, stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) == 5
    assert content_chunks[-1].choices[0].finish_reason == "length"
    final = chunks[-1]
    assert final.choices == []
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (4 + 3 + 4 + 1 + 4, 5)


async def test_completion_stream_and_raw_sse_framing(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker()
    async with aiohttp.ClientSession() as session, session.post(
            base_url(worker) + "/v1/completions",
            json={"model": MODEL, "prompt": "one two three", "max_tokens": 3, "stream": True}) as response:
        assert response.headers[WORKER_HEADER] == worker.spec.worker_id
        assert response.headers["Content-Type"].startswith("text/event-stream")
        body = (await response.read()).decode()
    events = [block for block in body.split("\n\n") if block]
    assert all(event.startswith("data: ") for event in events)
    assert events[-1] == "data: [DONE]"
    assert len(events) == 4
    async with client(worker) as sdk:
        stream = await sdk.completions.create(model=MODEL, prompt="one two three", max_tokens=3, stream=True)
        texts = [chunk.choices[0].text async for chunk in stream]
    assert len(texts) == 3


@pytest.mark.parametrize(("call", "error_type", "status"), [
    ("unknown_model", openai.NotFoundError, 404),
    ("too_long", openai.BadRequestError, 400),
    ("prompt_over_limit", openai.BadRequestError, 400),
    ("n_2", openai.BadRequestError, 400),
])
async def test_sdk_sees_vllm_errors(start_simworker: StartSimWorker, call: str, error_type: type[openai.APIStatusError],
                                    status: int) -> None:
    worker = await start_simworker(max_model_len=64)
    async with client(worker) as sdk:
        with pytest.raises(error_type) as raised:
            if call == "unknown_model":
                await sdk.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
            elif call == "too_long":
                await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=100)
            elif call == "prompt_over_limit":
                await sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w " * 80}])
            else:
                await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2, n=2)
    assert raised.value.status_code == status
    assert raised.value.response.headers[WORKER_HEADER] == worker.spec.worker_id
    error = raised.value.response.json()["error"]
    assert error["code"] == status and error["message"] and "type" in error and "param" in error


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/chat/completions", b'{"model": "sim-llama-3-8b"}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}'),
    ("/v1/completions", b'{"prompt": "hi", "stream": "yes"}'),
    ("/v1/completions", b'{"prompt": {"text": "hi"}}'),
    ("/v1/chat/completions", b'{"messages": [{"content": "hi"}]}'),
])
async def test_malformed_requests_are_400_json(start_simworker: StartSimWorker, path: str, body: bytes) -> None:
    worker = await start_simworker()
    async with aiohttp.ClientSession() as session, session.post(
            base_url(worker) + path, data=body, headers={"Content-Type": "application/json"}) as response:
        assert response.status == 400
        assert response.headers[WORKER_HEADER] == worker.spec.worker_id
        error = (await response.json())["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400


async def test_bad_request_does_not_disturb_a_running_stream(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(time_scale=5.0)
    async with client(worker) as sdk, aiohttp.ClientSession() as session:
        async def stream_all() -> int:
            stream = await sdk.completions.create(model=MODEL, prompt="steady", max_tokens=30, stream=True,
                                                  extra_body={"ignore_eos": True})
            return len([chunk async for chunk in stream])

        streaming = asyncio.create_task(stream_all())
        await asyncio.sleep(0.02)
        for _ in range(5):
            async with session.post(base_url(worker) + "/v1/completions", data=b"{") as response:
                assert response.status == 400
        assert await streaming == 30


async def test_health_version_and_metrics_names(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(legacy_kv_metric=True, enable_prefix_caching=True)
    async with client(worker) as sdk:
        await sdk.completions.create(model=MODEL, prompt="count these tokens", max_tokens=4)
    async with aiohttp.ClientSession() as session:
        async with session.get(base_url(worker) + "/health") as response:
            assert (response.status, await response.read()) == (200, b"")
        async with session.get(base_url(worker) + "/version") as response:
            assert isinstance((await response.json())["version"], str)
        async with session.get(base_url(worker) + "/metrics") as response:
            assert response.headers[WORKER_HEADER] == worker.spec.worker_id
            text = await response.text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    samples = {sample.name: sample for family in families.values() for sample in family.samples}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:cache_config_info", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                 "vllm:request_queue_time_seconds_bucket", "poolgate_sim_gpu_memory_total_bytes",
                 "poolgate_sim_gpu_memory_used_bytes", "poolgate_sim_gpu_utilization",
                 "poolgate_sim_step_lag_seconds_count"):
        assert name in samples, name
    running = samples["vllm:num_requests_running"]
    assert running.labels == {"engine": "0", "model_name": MODEL}
    assert samples["vllm:prompt_tokens_total"].value == 3
    assert samples["vllm:generation_tokens_total"].value == 4
    cache_info = samples["vllm:cache_config_info"]
    assert cache_info.value == 1.0
    assert cache_info.labels["block_size"] == "16"
    assert int(cache_info.labels["num_gpu_blocks"]) == worker.engine_config.num_gpu_blocks
    assert samples["vllm:time_to_first_token_seconds_count"].value == 1


async def test_client_disconnect_aborts_and_frees_kv(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(time_scale=1.0)
    async with aiohttp.ClientSession() as session:
        body = {"prompt": "long " * 200, "max_tokens": 1000, "ignore_eos": True, "stream": True}
        async with session.post(base_url(worker) + "/v1/completions", json=body) as response:
            await response.content.readuntil(b"\n\n")
            assert worker.engine.num_running == 1
            assert worker.engine.kv.used_blocks > 0
            response.close()
        for _ in range(100):
            if worker.engine.num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert worker.engine.num_running == 0
        assert worker.engine.kv.used_blocks == 0
        samples = await metric_samples(session, worker)
    assert samples["vllm:request_success_total{abort}"] == 1
    assert samples["vllm:kv_cache_usage_perc"] == 0


async def test_fault_api_is_absent_without_the_flag(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker()
    async with aiohttp.ClientSession() as session:
        for method in ("GET", "POST"):
            async with session.request(method, base_url(worker) + "/sim/faults", json={"error_rate": 1}) as response:
                assert response.status == 404
                assert response.headers[WORKER_HEADER] == worker.spec.worker_id


async def test_error_rate_fault_through_the_api(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(enable_fault_api=True)
    async with aiohttp.ClientSession() as session, client(worker) as sdk:
        async with session.post(base_url(worker) + "/sim/faults", json={"error_rate": 1.0}) as response:
            assert response.status == 200
            assert (await response.json())["error_rate"] == 1.0
        for _ in range(3):
            with pytest.raises(openai.InternalServerError) as raised:
                await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert raised.value.response.headers[WORKER_HEADER] == worker.spec.worker_id
            assert raised.value.response.json()["error"]["code"] == 500
        async with session.post(base_url(worker) + "/sim/faults", json={"error_rate": 2}) as response:
            assert response.status == 400
        async with session.post(base_url(worker) + "/sim/faults", json={"error_rate": 0}) as response:
            assert response.status == 200
        completion = await sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert completion.choices[0].finish_reason == "length"


async def test_slow_start_answers_503_then_200(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(faults=FaultSettings(slow_start_s=0.4))
    async with aiohttp.ClientSession() as session:
        async with session.get(base_url(worker) + "/health") as response:
            assert response.status == 503
        async with session.post(base_url(worker) + "/v1/completions", json={"prompt": "hi"}) as response:
            assert response.status == 503
            assert (await response.json())["error"]["code"] == 503
        await asyncio.sleep(0.45)
        async with session.get(base_url(worker) + "/health") as response:
            assert response.status == 200


async def test_hang_accepts_and_never_answers(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(enable_fault_api=True, faults=FaultSettings(hang=True))
    async with aiohttp.ClientSession() as session:
        with pytest.raises(asyncio.TimeoutError):
            async with session.get(base_url(worker) + "/health", timeout=aiohttp.ClientTimeout(total=0.3)):
                pass
        async with session.post(base_url(worker) + "/sim/faults", json={"hang": False}) as response:
            assert response.status == 200
        async with session.get(base_url(worker) + "/health") as response:
            assert response.status == 200


async def test_kv_leak_shrinks_capacity(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(num_gpu_blocks=1000, max_model_len=1024,
                                faults=FaultSettings(kv_leak_blocks_per_s=1000))
    await asyncio.sleep(0.3)
    async with aiohttp.ClientSession() as session:
        samples = await metric_samples(session, worker)
    assert samples["vllm:kv_cache_usage_perc"] >= 0.2
    assert samples["poolgate_sim_kv_leaked_blocks"] >= 200


async def test_crash_after_requests_kills_the_worker(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(faults=FaultSettings(crash_after_requests=1))
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url(worker) + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 200
        async with session.post(base_url(worker) + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 500
        async with session.get(base_url(worker) + "/health") as response:
            assert response.status == 503
    assert worker.crashed.is_set()
    for _ in range(60):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", worker.spec.port)
        except OSError:
            break
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the crashed worker still accepts connections")


async def test_an_api_key_guards_v1_paths_as_vllm_does(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(api_key="worker-key")
    async with aiohttp.ClientSession() as session:
        for headers in ({}, {"Authorization": "Bearer another-key"}, {"Authorization": "worker-key"}):
            async with session.get(base_url(worker) + "/v1/models", headers=headers) as response:
                assert response.status == 401 and await response.json() == {"error": "Unauthorized"}
        for path in ("/health", "/metrics", "/version"):  # probes and scrapers need no key
            async with session.get(base_url(worker) + path) as response:
                assert response.status == 200, path
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with openai.AsyncOpenAI(base_url=base_url(worker) + "/v1", api_key="worker-key", max_retries=0) as keyed:
        assert (await keyed.chat.completions.create(**chat)).choices[0].message.content
    async with client(worker) as unkeyed:
        with pytest.raises(openai.AuthenticationError):
            await unkeyed.chat.completions.create(**chat)
