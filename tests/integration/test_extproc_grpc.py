"""extproc over real gRPC against a real Redis: what Envoy would receive, and shared in-flight accounting."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    HttpBody,
    HttpHeaders,
    ProcessingRequest,
    ProcessingResponse,
)
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

from extproc.inflight import InflightTracker
from extproc.metrics import Metrics
from extproc.server import redis_client as make_redis_client
from extproc.server import serve
from extproc.watcher import FleetWatcher
from poolgate.kernel.config import Config, ExtprocSettings, PoolSpec
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.routing import CLUSTER_HEADER, DESTINATION_ENDPOINT_KEY, LB_METADATA_NAMESPACE
from poolgate.kernel.store import FleetStore
from poolgate.procs import free_port

PREFIX = "itest"
KEYS = RedisKeys(PREFIX)
LIMIT = 64 * 1024
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hello"}]}


def config(refresh_s: float = 0.05) -> Config:
    return Config(key_prefix=PREFIX, pools=(PoolSpec(name="chat", model="llama"), PoolSpec(name="code",
                                                                                            model="coder")),
                  extproc=ExtprocSettings(max_request_bytes=LIMIT, snapshot_refresh_s=refresh_s))


def record(worker_id: str, port: int, pool: str = "chat", **live: object) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool=pool, model="llama" if pool == "chat" else "coder",
                        host="127.0.0.1", port=port, **live)  # type: ignore[arg-type]


def headers(method: str, path: str, end: bool = False, extra: dict[str, str] | None = None,
            **named: str) -> ProcessingRequest:
    extra = {**(extra or {}), **named}
    pairs = [(":method", method), (":path", path), *((k.replace("_", "-"), v) for k, v in extra.items())]
    values = [HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
    return ProcessingRequest(request_headers=HttpHeaders(headers=HeaderMap(headers=values), end_of_stream=end))


def body(data: object) -> ProcessingRequest:
    raw = data if isinstance(data, bytes) else orjson.dumps(data)
    return ProcessingRequest(request_body=HttpBody(body=raw, end_of_stream=True))


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@dataclass
class Extproc:
    stub: ExternalProcessorStub
    port: int

    async def exchange(self, *messages: ProcessingRequest) -> list[ProcessingResponse]:
        """One whole ext_proc stream: send each message, read each answer, close."""
        call = self.stub.Process()
        answers = []
        for message in messages:
            await call.write(message)
            answers.append(await call.read())
            if answers[-1].HasField("immediate_response"):
                break
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        return answers

    async def open_routed(self, data: object = CHAT) -> tuple[grpc.aio.StreamStreamCall, ProcessingResponse]:
        """A routed request whose stream stays open (as while Envoy proxies the HTTP request)."""
        call = self.stub.Process()
        await call.write(headers("POST", "/v1/chat/completions"))
        await call.read()
        await call.write(body(data))
        return call, await call.read()


@contextlib.asynccontextmanager
async def running_extproc(redis_url: str, cfg: Config | None = None) -> AsyncIterator[Extproc]:
    bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(cfg or config(), redis_url, "127.0.0.1", 0, free_port(),
                                     on_listening=bound.set_result))
    port = await asyncio.wait_for(asyncio.shield(bound), 10)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Extproc(ExternalProcessorStub(channel), port)
    finally:
        await channel.close()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


def pin_of(answer: ProcessingResponse) -> str:
    fields = answer.dynamic_metadata.fields[LB_METADATA_NAMESPACE].struct_value.fields
    return fields[DESTINATION_ENDPOINT_KEY].string_value


async def test_routed_request(redis_url: str, redis_client: Any) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(record("w1", 9001), ttl_s=30)
    async with running_extproc(redis_url) as extproc:
        first, second = await extproc.exchange(
            headers("POST", "/v1/chat/completions", extra={CLUSTER_HEADER: "pool-evil",
                                                      DESTINATION_ENDPOINT_KEY: "6.6.6.6:6"}),
            body(CHAT))
    assert first.WhichOneof("response") == "request_headers"
    common = second.request_body.response
    assert common.clear_route_cache
    assert [(h.header.key, h.header.raw_value) for h in common.header_mutation.set_headers] == [
        (CLUSTER_HEADER, b"pool-chat")]
    assert list(common.header_mutation.remove_headers) == ["authorization", DESTINATION_ENDPOINT_KEY]
    assert pin_of(second) == "127.0.0.1:9001"


@pytest.mark.parametrize(("messages", "status", "code"), [
    ((headers("POST", "/v1/chat/completions"), body({**CHAT, "model": "nope"})), 404, "model_not_found"),
    ((headers("POST", "/v1/chat/completions"), body(b"{bad")), 400, "invalid_json"),
    ((headers("POST", "/v1/chat/completions", content_length=str(LIMIT + 1)),), 413, "request_too_large"),
    ((headers("POST", "/v1/chat/completions"), body({"model": "llama", "messages": [{"content": "x" * LIMIT}]})),
     413, "request_too_large"),
    ((headers("POST", "/v1/completions"), body({"model": "coder", "prompt": "x"})), 503, "no_ready_worker"),
])
async def test_immediate_errors(redis_url: str, redis_client: Any,
                                messages: tuple[ProcessingRequest, ...], status: int, code: str) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(record("w1", 9001), ttl_s=30)
    await FleetStore(redis_client, KEYS.prefix).register(record("c1", 9002, "code", state=WorkerState.FAILED), ttl_s=30)
    async with running_extproc(redis_url) as extproc:
        answer = (await extproc.exchange(*messages))[-1].immediate_response
    assert answer.status.code == status
    assert orjson.loads(answer.body)["error"]["code"] == code
    headers_sent = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}
    assert headers_sent["content-type"] == b"application/json"
    assert ("retry-after" in headers_sent) == (status == 503)


async def test_model_list(redis_url: str) -> None:
    async with running_extproc(redis_url) as extproc:
        [answer] = await extproc.exchange(headers("GET", "/v1/models", end=True))
    assert answer.immediate_response.status.code == 200
    assert [m["id"] for m in orjson.loads(answer.immediate_response.body)["data"]] == ["llama", "coder"]


async def test_registration_is_seen_through_pubsub(redis_url: str, redis_client: Any) -> None:
    # A 5 s period: only the change notification can make the new worker visible this fast.
    async with running_extproc(redis_url, config(refresh_s=5)) as extproc:
        [_, answer] = await extproc.exchange(headers("POST", "/v1/chat/completions"), body(CHAT))
        assert answer.immediate_response.status.code == 503
        await asyncio.sleep(0.1)  # let the subscription settle
        await FleetStore(redis_client, KEYS.prefix).register(record("late", 9005), ttl_s=30)
        started = time.monotonic()

        async def routed() -> bool:
            answers = await extproc.exchange(headers("POST", "/v1/chat/completions"), body(CHAT))
            return pin_of(answers[-1]) == "127.0.0.1:9005"

        await eventually(routed, timeout_s=2)
        assert time.monotonic() - started < 2


async def test_inflight_is_in_redis_until_the_stream_ends(redis_url: str,
                                                          redis_client: Any) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(record("w1", 9001), ttl_s=30)
    async with running_extproc(redis_url) as extproc:
        calls = [await extproc.open_routed() for _ in range(3)]

        async def inflight_is(n: int) -> bool:
            return int(await redis_client.hget(KEYS.inflight, "w1") or 0) == n

        await eventually(lambda: inflight_is(3))
        for call, _ in calls[:2]:
            await call.done_writing()
            assert await call.read() is grpc.aio.EOF
        await eventually(lambda: inflight_is(1))
        calls[2][0].cancel()  # Envoy resetting the stream also ends the request
        await eventually(lambda: inflight_is(0))


async def test_two_replicas_see_each_others_inflight(redis_url: str, redis_client: Any) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(record("a", 9001), ttl_s=30)
    await FleetStore(redis_client, KEYS.prefix).register(record("b", 9002), ttl_s=30)
    async with running_extproc(redis_url) as one, running_extproc(redis_url) as two:
        held = [await one.open_routed() for _ in range(4)]
        pins = [pin_of(answer).split(",")[0] for _, answer in held]
        assert sorted(pins) == ["127.0.0.1:9001"] * 2 + ["127.0.0.1:9002"] * 2  # spread by local accounting
        extra, answer = await one.open_routed()
        busy = pin_of(answer).split(",")[0]  # now 3 on one worker, 2 on the other
        await eventually(lambda: _redis_total(redis_client, ["a", "b"], 5))
        await asyncio.sleep(0.15)  # at least one refresh of replica two after the counters landed
        for _ in range(5):
            answers = await two.exchange(headers("POST", "/v1/chat/completions"), body(CHAT))
            assert pin_of(answers[-1]).split(",")[0] != busy
        for call, _ in [*held, (extra, answer)]:
            call.cancel()
        await eventually(lambda: _redis_total(redis_client, ["a", "b"], 0))


async def _redis_total(client: Any, ids: list[str], expected: int) -> bool:
    values = [int(await client.hget(KEYS.inflight, i) or 0) for i in ids]
    return sum(values) == expected


async def test_a_slow_read_leaves_no_worker_stale(redis_client: Any) -> None:
    """A refresh whose reads take longer than the staleness bound (a loaded Redis, 10,000 workers) still
    judges freshness from when the read ended, so the fleet stays pickable and the age metric is the read's."""
    await FleetStore(redis_client, KEYS.prefix).register(record("w1", 9001), ttl_s=30)
    metrics = Metrics()
    settings = config().extproc
    clock = [time.time()]
    watcher = FleetWatcher(FleetStore(redis_client, KEYS.prefix), config().pools, settings, InflightTracker(),
                           metrics, clock=lambda: clock[0])
    sync = watcher._view.sync

    async def slow_sync() -> Any:
        delta = await sync()
        clock[0] += 3 * settings.stale_after_s  # the read took three staleness bounds
        return delta

    watcher._view.sync = slow_sync  # type: ignore[method-assign]
    for _ in range(2):
        assert await watcher.refresh()
        snapshot = watcher.snapshot
        assert snapshot.stale_workers == 0 and [w.id for w in snapshot.ready_workers_for("llama")] == ["w1"]
        assert metrics.registry.get_sample_value("poolgate_extproc_stale_workers") == 0
        assert (metrics.registry.get_sample_value("poolgate_extproc_snapshot_age_seconds") or 0) < 1


async def test_redis_outage_keeps_the_last_snapshot(redis_url: str, redis_client: Any) -> None:
    await FleetStore(redis_client, KEYS.prefix).register(record("w1", 9001), ttl_s=30)
    metrics = Metrics()
    clock = [time.time()]
    watcher = FleetWatcher(FleetStore(redis_client, KEYS.prefix), config().pools, config().extproc, InflightTracker(),
                           metrics, clock=lambda: clock[0])
    assert await watcher.refresh()
    kept = watcher.snapshot
    assert [w.id for w in kept.workers] == ["w1"]
    dead = make_redis_client(f"redis://127.0.0.1:{free_port()}/0")
    watcher._store = FleetStore(dead, KEYS.prefix)  # the same store, as seen after Redis went away
    try:
        clock[0] += 60
        assert not await watcher.refresh()
        assert watcher.snapshot is kept and kept.is_fresh(kept.workers[0])
        assert metrics.registry.get_sample_value("poolgate_extproc_redis_up") == 0
        assert (metrics.registry.get_sample_value("poolgate_extproc_snapshot_age_seconds") or 0) >= 60
    finally:
        await dead.aclose()
    watcher._store = FleetStore(redis_client, KEYS.prefix)
    assert await watcher.refresh()
    assert metrics.registry.get_sample_value("poolgate_extproc_redis_up") == 1
