"""Two simulated workers over real HTTP driving vLLM's disaggregated protocol as its proxies do: the prefill
worker answers params, the decode worker reads the KV and streams without prefilling; stale params refused."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import aiohttp
import pytest

from poolgate.procs import free_port
from simworker.kv_transfer import KVTransferConfig
from simworker.worker import SimWorker
from tests.conftest import StartSimWorker

MODEL = "sim-llama-3-8b"
PROMPT = "summarise " * 6000


def role(kv_role: str, abort_timeout_s: float = 480.0) -> KVTransferConfig:
    return KVTransferConfig("NixlConnector", kv_role, abort_timeout_s=abort_timeout_s)  # type: ignore[arg-type]


@pytest.fixture()
def start_worker(start_simworker: StartSimWorker) -> StartSimWorker:
    """Workers with a long context, at 4× real speed and without step jitter, so transfer times compare."""
    return functools.partial(start_simworker, time_scale=4.0, max_model_len=16384, step_jitter=0.0)


def url(worker: SimWorker, path: str) -> str:
    return f"http://127.0.0.1:{worker.spec.port}{path}"


def prefill_body() -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                   "remote_block_ids": None, "remote_host": None, "remote_port": None}}


async def first_event_s(session: aiohttp.ClientSession, worker: SimWorker, body: dict[str, Any]) -> float:
    started = time.perf_counter()
    async with session.post(url(worker, "/v1/completions"), json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if line.startswith(b"data: {"):
                elapsed = time.perf_counter() - started
                await response.read()
                return elapsed
    raise AssertionError("no event")


async def test_prefill_then_decode_skips_the_prompt_on_the_decode_worker(start_worker: StartSimWorker) -> None:
    prefill = await start_worker(kv_transfer=role("kv_producer"), time_scale=1.0)  # real time: Python's own
    decode = await start_worker(kv_transfer=role("kv_consumer"), time_scale=1.0)  # costs stay small beside it
    async with aiohttp.ClientSession() as session:
        async with session.post(url(prefill, "/v1/completions"), json=prefill_body()) as response:
            assert response.status == 200
            answer = await response.json()
        params = answer["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_engine_id"] == prefill.spec.worker_id
        assert params["remote_port"] == prefill.spec.port
        assert len(params["remote_block_ids"]) == -(-answer["usage"]["prompt_tokens"] // 16)
        assert answer["usage"]["completion_tokens"] == 1
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "stream": True}
        with_kv = await first_event_s(session, decode, {**body, "kv_transfer_params": params})
        plain = await first_event_s(session, decode, {**body, "prompt": "condense " * 6000})  # as long, uncached
        print(f"decode first event: {with_kv * 1000:.1f} ms with remote KV, {plain * 1000:.1f} ms prefilling")
        assert with_kv < plain * 0.75  # the modelled part halves; the same Python parsing is in both
        # read once to the end: the producer freed the blocks, the same params are now refused
        async with session.post(url(decode, "/v1/completions"),
                                json={**body, "kv_transfer_params": params}) as response:
            assert response.status == 400
            error = (await response.json())["error"]
            assert error["param"] == "kv_transfer_params" and "unknown" in error["message"]


async def test_expired_and_invented_params_are_refused(start_worker: StartSimWorker) -> None:
    prefill = await start_worker(kv_transfer=role("kv_producer", abort_timeout_s=0.4))  # model s; 0.1 s real
    decode = await start_worker(kv_transfer=role("kv_consumer"))
    body = {"model": MODEL, "prompt": "hello " * 50, "max_tokens": 4}
    async with aiohttp.ClientSession() as session:
        async with session.post(url(prefill, "/v1/completions"), json={**prefill_body(), "prompt": body["prompt"]}) \
                as response:
            params = (await response.json())["kv_transfer_params"]
        await asyncio.sleep(0.3)
        async with session.post(url(decode, "/v1/completions"), json={**body, "kv_transfer_params": params}) as r:
            assert r.status == 400
            assert "expired" in (await r.json())["error"]["message"]
        invented = {**params, "remote_request_id": "cmpl-never"}
        async with session.post(url(decode, "/v1/completions"), json={**body, "kv_transfer_params": invented}) as r:
            assert r.status == 400 and "unknown" in (await r.json())["error"]["message"]
        gone = {**params, "remote_port": free_port()}
        async with session.post(url(decode, "/v1/completions"), json={**body, "kv_transfer_params": gone}) as r:
            assert r.status == 400 and "unreachable" in (await r.json())["error"]["message"]
        async with session.post(url(decode, "/v1/completions"), json=body) as r:
            assert r.status == 200  # a plain request still works: the fallback
