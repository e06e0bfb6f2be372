"""The simulated worker's sleep mode, as vLLM's: asleep it answers its health probe, reports the sleep in
``vllm:engine_sleep_state`` (read by the agent's own parser), serves nothing; woken it serves again."""

from __future__ import annotations

from typing import Any

import aiohttp

from agent.vllm_metrics import parse_engine_metrics
from tests.conftest import StartSimWorker

CHAT = {"model": "sim-llama-3-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _sleep_level(session: aiohttp.ClientSession, base: str) -> int | None:
    async with session.get(base + "/metrics") as response:
        return parse_engine_metrics(await response.text()).sleep_level


async def _status(session: aiohttp.ClientSession, method: str, url: str, **kwargs: Any) -> int:
    async with session.request(method, url, **kwargs) as response:
        await response.read()
        return response.status


async def test_a_sleeping_worker_serves_nothing_until_it_wakes(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker(enable_sleep_mode=True, wake_up_s=0.05)
    base = f"http://127.0.0.1:{worker.spec.port}"
    async with aiohttp.ClientSession() as session:
        assert await _sleep_level(session, base) == 0
        assert await _status(session, "POST", base + "/sleep?level=1") == 200
        assert await _sleep_level(session, base) == 1
        assert await _status(session, "GET", base + "/health") == 200
        assert await _status(session, "POST", base + "/v1/chat/completions", json=CHAT) == 503
        async with session.get(base + "/is_sleeping") as response:
            assert (await response.json()) == {"is_sleeping": True}
        assert await _status(session, "POST", base + "/sleep?level=3") == 400
        assert await _status(session, "POST", base + "/wake_up") == 200
        assert await _sleep_level(session, base) == 0
        assert await _status(session, "POST", base + "/v1/chat/completions", json=CHAT) == 200


async def test_without_sleep_mode_there_is_no_sleep_endpoint(start_simworker: StartSimWorker) -> None:
    worker = await start_simworker()
    base = f"http://127.0.0.1:{worker.spec.port}"
    async with aiohttp.ClientSession() as session:
        assert await _status(session, "POST", base + "/sleep") == 404
        assert await _sleep_level(session, base) is None
