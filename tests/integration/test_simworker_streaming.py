"""A simulated worker's chat stream: the role chunk comes with the first token, as vLLM sends it."""

from __future__ import annotations

import aiohttp
import orjson

from tests.conftest import StartSimWorker
from tests.integration.test_simworker_http import MODEL, base_url, metric_samples


async def test_role_chunk_waits_for_the_first_token(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(time_scale=1.0)  # a 4k-token prefill takes ~0.15 s of real time
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 4000}], "max_tokens": 3,
            "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url(worker) + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            first = orjson.loads((await response.content.readuntil(b"\n\n"))[len(b"data: "):])
            at_first_event = await metric_samples(session, worker)
            rest = [line for line in (await response.read()).split(b"\n\n") if line]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    assert at_first_event["vllm:time_to_first_token_seconds_count"] == 1  # prefill was over
    tokens = [orjson.loads(event[len(b"data: "):]) for event in rest[:-1]]
    assert rest[-1] == b"data: [DONE]"
    assert len(tokens) == 3
    assert all(set(t["choices"][0]["delta"]) == {"content"} and t["choices"][0]["delta"]["content"] for t in tokens)


async def test_a_completion_stream_has_no_role_chunk(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker()
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(base_url(worker) + "/v1/completions", json=body) as response:
            events = [line for line in (await response.read()).split(b"\n\n") if line]
    assert len(events) == 3 and events[-1] == b"data: [DONE]"
    assert all(orjson.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
