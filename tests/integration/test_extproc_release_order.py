"""Deadline-aware release over real gRPC against a real Redis: with the prefill-backlog gate on, long prompts
that would queue behind a backlogged engine are held in extproc, and a short request sent after them is
placed at once, overtaking them; they follow when the backlog clears."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingResponse

from poolgate.kernel.config import Config, ExtprocSettings, PoolSpec, SchedulingSettings
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore
from tests.integration.test_extproc_grpc import KEYS, PREFIX, Extproc, body, headers, pin_of, running_extproc


def chat(words: int) -> dict[str, object]:
    return {"model": "llama", "max_tokens": 20, "messages": [{"role": "user", "content": "tokens " * words}]}


LONG = chat(4000)
"""About 7000 prompt tokens: behind 30 waiting requests of that size at 10k tokens/s, 21 s of prefill."""
SHORT = chat(20)


def config() -> Config:
    return Config(key_prefix=PREFIX, pools=(PoolSpec(name="chat", model="llama", max_model_len=16384),),
                  extproc=ExtprocSettings(snapshot_refresh_s=0.05),
                  scheduling=SchedulingSettings(max_wait_s=8.0, max_prefill_backlog_s=0.25))


def worker(waiting: int) -> WorkerRecord:
    return WorkerRecord(id="w", pool="chat", model="llama", host="127.0.0.1", port=9001, max_model_len=16384,
                        kv_capacity_tokens=1_000_000, waiting=waiting, prefill_tokens_per_s=10_000.0)


async def exchange(extproc: Extproc, data: object) -> list[ProcessingResponse]:
    """Headers, then the body; reads answers until the final one (a hold sends a timeout extension first)."""
    call = extproc.stub.Process()
    await call.write(headers("POST", "/v1/chat/completions"))
    answers = [await call.read()]
    await call.write(body(data))
    answers.append(await call.read())
    if answers[-1].HasField("override_message_timeout"):
        answers.append(await call.read())
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF
    return answers


async def timed(extproc: Extproc, data: object) -> tuple[str, float]:
    answers = await exchange(extproc, data)
    return pin_of(answers[-1]), time.monotonic()


async def test_a_short_request_overtakes_held_long_prefills(redis_url: str, redis_client: Any) -> None:
    store = FleetStore(redis_client, KEYS.prefix)
    await store.register(worker(waiting=30), ttl_s=30)
    async with running_extproc(redis_url, config()) as extproc:
        longs = [asyncio.create_task(timed(extproc, LONG)) for _ in range(3)]
        await asyncio.sleep(0.5)
        assert not any(task.done() for task in longs)  # held: the engine's queue is long
        sent = time.monotonic()
        pin, short_done = await asyncio.wait_for(timed(extproc, SHORT), 5)
        assert pin == "127.0.0.1:9001"
        print(f"short request placed {short_done - sent:.3f} s after it was sent, ahead of 3 held long ones")
        assert not any(task.done() for task in longs)
        assert await store.heartbeat("w", ttl_s=30, announce=True, waiting=0)
        placed = await asyncio.wait_for(asyncio.gather(*longs), 8)
    assert all(pin == "127.0.0.1:9001" for pin, _ in placed)
    assert min(done for _, done in placed) > short_done
