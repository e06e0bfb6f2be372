"""Prefix caching of a simulated worker over HTTP: vLLM's counters and ``POST /reset_prefix_cache``."""

from __future__ import annotations

import aiohttp

from tests.conftest import StartSimWorker
from tests.integration.test_simworker_http import MODEL, base_url, client, metric_samples

DOCUMENT = " ".join(f"word{i % 97}" for i in range(300))


async def complete(worker_url: str, session: aiohttp.ClientSession, prompt: str, max_tokens: int = 2) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    async with session.post(worker_url + "/v1/completions", json=body) as response:
        assert response.status == 200


async def test_repeated_prompt_hits_the_cache_until_it_is_reset(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker()
    url = base_url(worker)
    async with aiohttp.ClientSession() as session:
        await complete(url, session, DOCUMENT)
        await complete(url, session, DOCUMENT + " and a question")
        after_two = await metric_samples(session, worker)
        async with session.post(url + "/reset_prefix_cache") as response:
            assert (response.status, await response.read()) == (200, b"")
        await complete(url, session, DOCUMENT)
        after_reset = await metric_samples(session, worker)
    prompt_tokens = 300
    assert after_two["vllm:prefix_cache_queries_total"] == 2 * prompt_tokens + 3  # " and a question"
    assert after_two["vllm:prefix_cache_hits_total"] == (prompt_tokens // 16) * 16  # whole blocks only
    assert after_reset["vllm:prefix_cache_queries_total"] == after_two["vllm:prefix_cache_queries_total"] + 300
    assert after_reset["vllm:prefix_cache_hits_total"] == after_two["vllm:prefix_cache_hits_total"]


async def test_turned_off_nothing_is_cached_or_counted(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(enable_prefix_caching=False)
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            await complete(base_url(worker), session, DOCUMENT)
        samples = await metric_samples(session, worker)
        async with session.get(base_url(worker) + "/metrics") as response:
            assert 'enable_prefix_caching="False"' in await response.text()
    assert samples["vllm:prefix_cache_queries_total"] == 0
    assert samples["vllm:prompt_tokens_total"] == 600


async def test_reset_running_requests_preempts_a_stream_which_still_completes(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(time_scale=2.0)
    url = base_url(worker)
    async with client(worker) as sdk, aiohttp.ClientSession() as session:
        stream = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": DOCUMENT}], max_tokens=40,
            extra_body={"ignore_eos": True}, stream=True)
        chunks = stream.__aiter__()
        await chunks.__anext__()  # the first token is out: the request holds blocks
        async with session.post(url + "/reset_prefix_cache") as refused:
            assert refused.status == 200  # vLLM answers 200 even when the engine refused
        async with session.post(url + "/reset_prefix_cache?reset_running_requests=true") as forced:
            assert forced.status == 200
        rest = [chunk async for chunk in chunks]
        samples = await metric_samples(session, worker)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in rest if chunk.choices)
    assert rest[-1].choices[0].finish_reason == "length"
    assert len(text.split()) >= 39
    assert samples["vllm:num_preemptions_total"] == 1
    assert samples["vllm:generation_tokens_total"] == 40


async def test_a_bad_reset_flag_is_a_400(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker()
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url(worker) + "/reset_prefix_cache?reset_running_requests=maybe") as response:
            assert response.status == 400
            body = await response.json()
    assert body["error"]["param"] == "reset_running_requests"


async def cached_prefix(url: str, session: aiohttp.ClientSession, body: dict[str, object]) -> dict[str, int]:
    async with session.post(url + "/sim/cached_prefix", json=body) as response:
        assert response.status == 200
        answer: dict[str, int] = await response.json()
        return answer


async def test_the_debug_endpoint_tells_the_cached_prefix_as_the_engine_counts_a_hit(
        start_simworker: StartSimWorker) -> None:
    """``/sim/cached_prefix`` (the benchmark oracle's ground truth) agrees with the hit counter's next step."""
    worker = await start_simworker()
    url = base_url(worker)
    question = {"model": MODEL, "prompt": DOCUMENT + " and a question", "max_tokens": 2}
    async with aiohttp.ClientSession() as session:
        cold = await cached_prefix(url, session, question)
        await complete(url, session, DOCUMENT)
        warm = await cached_prefix(url, session, question)
        before = await metric_samples(session, worker)
        await complete(url, session, DOCUMENT + " and a question")
        after = await metric_samples(session, worker)
        chat = await cached_prefix(url, session, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        async with session.post(url + "/reset_prefix_cache") as response:
            assert response.status == 200
        reset = await cached_prefix(url, session, question)
    assert (cold["cached_tokens"], cold["prompt_tokens"]) == (0, 303)
    assert warm["cached_tokens"] == (300 // 16) * 16
    assert after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] == warm["cached_tokens"]
    assert chat["cached_tokens"] == 0 and chat["prompt_tokens"] > 0 and chat["waiting"] == 0
    assert reset["cached_tokens"] == 0
