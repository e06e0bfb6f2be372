"""Resource-aware picking over real gRPC against a real Redis: KV-aware placement and bounded holding."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse
from test_extproc_grpc import KEYS, PREFIX, Extproc, body, headers, pin_of, running_extproc

from poolgate.kernel.config import Config, ExtprocSettings, PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore

LIMIT = 256 * 1024
LONG_PROMPT = {"model": "llama", "max_tokens": 50,
               "messages": [{"role": "user", "content": "tokens " * 4000}]}
"""About 7000 prompt tokens: fits an empty 10 000-token worker, not one at 50 % usage."""


def config(max_wait_s: float = 5.0) -> Config:
    return Config(key_prefix=PREFIX, pools=(PoolSpec(name="chat", model="llama", max_model_len=16384),),
                  extproc=ExtprocSettings(max_request_bytes=LIMIT, snapshot_refresh_s=0.05),
                  scheduling=SchedulingSettings(max_wait_s=max_wait_s, retry_after_s=2))


def worker(worker_id: str, port: int, kv_usage: float) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="chat", model="llama", host="127.0.0.1", port=port,
                        max_model_len=16384, kv_capacity_tokens=10_000, kv_usage=kv_usage)


async def held_exchange(extproc: Extproc, data: object) -> tuple[list[ProcessingResponse], float]:
    """Headers, then the body; reads answers until the final one (a hold sends a timeout extension first)."""
    call = extproc.stub.Process()
    await call.write(headers("POST", "/v1/chat/completions"))
    answers = [await call.read()]
    await call.write(body(data))
    started = time.monotonic()
    answers.append(await call.read())
    if answers[-1].HasField("override_message_timeout"):
        answers.append(await call.read())
    elapsed = time.monotonic() - started
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return answers, elapsed


async def test_the_fuller_worker_is_avoided(redis_url: str, redis_client: Any) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(worker("empty", 9001, kv_usage=0.1), ttl_s=30)
    await FleetStore(redis_client, KEYS.prefix).register(worker("full", 9002, kv_usage=0.6), ttl_s=30)
    chat = {"model": "llama", "messages": [{"role": "user", "content": "hello " * 100}]}
    async with running_extproc(redis_url, config()) as extproc:
        for _ in range(10):
            answers = await extproc.exchange(headers("POST", "/v1/chat/completions"), body(chat))
            assert pin_of(answers[-1]).split(",")[0] == "127.0.0.1:9001"


async def test_a_prompt_that_fits_nowhere_waits_then_gets_429(redis_url: str, redis_client: Any) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(worker("a", 9001, kv_usage=0.5), ttl_s=30)
    await FleetStore(redis_client, KEYS.prefix).register(worker("b", 9002, kv_usage=0.6), ttl_s=30)
    async with running_extproc(redis_url, config(max_wait_s=0.5)) as extproc:
        (_, extend, final), elapsed = await held_exchange(extproc, LONG_PROMPT)
    assert extend.override_message_timeout.ToTimedelta().total_seconds() == pytest.approx(2.5)
    assert 0.5 <= elapsed < 2.0
    reply = final.immediate_response
    assert reply.status.code == 429
    sent = {h.header.key: h.header.raw_value for h in reply.headers.set_headers}
    assert sent["retry-after"] == b"2" and sent["content-type"] == b"application/json"
    error = orjson.loads(reply.body)["error"]
    assert (error["code"], error["type"]) == ("no_capacity", "rate_limit_error")
    assert not final.HasField("dynamic_metadata")  # never pinned to a full worker


async def test_a_held_prompt_is_placed_when_capacity_frees(redis_url: str, redis_client: Any) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(worker("a", 9001, kv_usage=0.5), ttl_s=30)
    await FleetStore(redis_client, KEYS.prefix).register(worker("b", 9002, kv_usage=0.6), ttl_s=30)
    async with running_extproc(redis_url, config(max_wait_s=5)) as extproc:
        exchange = asyncio.create_task(held_exchange(extproc, LONG_PROMPT))
        await asyncio.sleep(0.4)
        assert not exchange.done()
        assert await FleetStore(redis_client, KEYS.prefix).heartbeat("b", ttl_s=30, announce=True, kv_usage=0.05)
        (_, extend, final), elapsed = await asyncio.wait_for(exchange, 5)
    assert extend.HasField("override_message_timeout")
    assert 0.3 <= elapsed < 2.0  # held until the record changed (the clock starts just after the sleep does)
    assert final.request_body.response.clear_route_cache
    assert pin_of(final) == "127.0.0.1:9002"
