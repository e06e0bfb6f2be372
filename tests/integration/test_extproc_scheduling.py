"""Resource-aware picking over real gRPC against a real Redis: KV-aware placement and bounded holding."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse

from poolgate.kernel.config import Config, ExtprocSettings, PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore
from tests.integration.test_extproc_grpc import KEYS, PREFIX, Extproc, body, headers, pin_of, running_extproc

LIMIT = 256 * 1024
LONG_PROMPT = {"model": "llama", "max_tokens": 50,
               "messages": [{"role": "user", "content": "tokens " * 4000}]}
"""About 7000 prompt tokens: fits an empty 10 000-token worker, not one at 50 % usage."""


def config(max_wait_s: float = 5.0, weights: dict[str, float] | None = None) -> Config:
    scheduling = SchedulingSettings(max_wait_s=max_wait_s, retry_after_s=2)
    if weights is not None:
        scheduling = SchedulingSettings(max_wait_s=max_wait_s, retry_after_s=2, weights=weights)
    return Config(key_prefix=PREFIX, pools=(PoolSpec(name="chat", model="llama", max_model_len=16384),),
                  extproc=ExtprocSettings(max_request_bytes=LIMIT, snapshot_refresh_s=0.05), scheduling=scheduling)


KV_WEIGHTED = {"predicted_ttft": 3.0, "kv_headroom": 2.0, "inflight": 1.0}
"""A weighted sum that rates KV headroom. The default latency model rates KV only by what a request would evict,
and a short prompt evicts nothing on either worker here."""


def worker(worker_id: str, port: int, kv_usage: float) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="chat", model="llama", host="127.0.0.1", port=port,
                        max_model_len=16384, kv_capacity_tokens=10_000, kv_usage=kv_usage)


async def open_held(extproc: Extproc, data: object) -> tuple[grpc.aio.StreamStreamCall, ProcessingResponse, float]:
    """Headers, then the body, up to extproc's first answer to the body: the longer message timeout it asks
    of Envoy when it holds the request. Returns the open stream, that answer, and when the body was sent."""
    call = extproc.stub.Process()
    await call.write(headers("POST", "/v1/chat/completions"))
    await call.read()
    sent = time.monotonic()
    await call.write(body(data))
    extend = await call.read()
    assert extend.HasField("override_message_timeout"), extend  # held, not answered at once
    return call, extend, sent


async def close(call: grpc.aio.StreamStreamCall) -> None:
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF


async def test_the_fuller_worker_is_avoided(redis_url: str, redis_client: Any) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(worker("empty", 9001, kv_usage=0.1), ttl_s=30)
    await FleetStore(redis_client, KEYS.prefix).register(worker("full", 9002, kv_usage=0.6), ttl_s=30)
    chat = {"model": "llama", "messages": [{"role": "user", "content": "hello " * 100}]}
    async with running_extproc(redis_url, config(weights=KV_WEIGHTED)) as extproc:
        for _ in range(10):
            answers = await extproc.exchange(headers("POST", "/v1/chat/completions"), body(chat))
            assert pin_of(answers[-1]).split(",")[0] == "127.0.0.1:9001"


async def test_a_prompt_that_fits_nowhere_waits_then_gets_429(redis_url: str, redis_client: Any) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(worker("a", 9001, kv_usage=0.5), ttl_s=30)
    await FleetStore(redis_client, KEYS.prefix).register(worker("b", 9002, kv_usage=0.6), ttl_s=30)
    async with running_extproc(redis_url, config(max_wait_s=0.5)) as extproc:
        call, extend, sent = await open_held(extproc, LONG_PROMPT)
        final = await call.read()
        elapsed = time.monotonic() - sent  # from before the body left: the hold cannot have started earlier
        await close(call)
    granted = extend.override_message_timeout.ToTimedelta().total_seconds()
    print(f"\nmeasured: 429 {elapsed:.2f} s after the body was sent (max_wait_s 0.5, Envoy told to wait {granted} s)")
    assert granted == pytest.approx(2.5)
    assert elapsed >= 0.5  # held for its whole wait
    assert elapsed < granted  # answered before Envoy's extended timeout would fail the request
    reply = final.immediate_response
    assert reply.status.code == 429
    sent_headers = {h.header.key: h.header.raw_value for h in reply.headers.set_headers}
    assert sent_headers["retry-after"] == b"2" and sent_headers["content-type"] == b"application/json"
    error = orjson.loads(reply.body)["error"]
    assert (error["code"], error["type"]) == ("no_capacity", "rate_limit_error")
    assert not final.HasField("dynamic_metadata")  # never pinned to a full worker


async def test_a_held_prompt_is_placed_when_capacity_frees(redis_url: str, redis_client: Any) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(worker("a", 9001, kv_usage=0.5), ttl_s=30)
    await FleetStore(redis_client, KEYS.prefix).register(worker("b", 9002, kv_usage=0.6), ttl_s=30)
    max_wait_s = 30.0
    async with running_extproc(redis_url, config(max_wait_s=max_wait_s)) as extproc:
        call, _, _ = await open_held(extproc, LONG_PROMPT)
        answer = asyncio.create_task(call.read())
        await asyncio.sleep(0.3)
        assert not answer.done()  # still held: nothing has room yet
        freed = time.monotonic()
        assert await FleetStore(redis_client, KEYS.prefix).heartbeat("b", ttl_s=30, announce=True, kv_usage=0.05)
        final = await asyncio.wait_for(answer, max_wait_s / 2)
        placed_s = time.monotonic() - freed
        await close(call)
    print(f"\nmeasured: placed {placed_s:.2f} s after worker b's KV freed (max_wait_s {max_wait_s:g})")
    # Placed by the change, long before the deadline's last pick could have placed it.
    assert final.request_body.response.clear_route_cache
    assert pin_of(final) == "127.0.0.1:9002"
