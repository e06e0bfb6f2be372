"""Quotas over real gRPC against one Redis, with two extproc processes: limits hold across both, and the
tokens charged at admission are corrected from the usage the response reports."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import orjson
import pytest
import redis.asyncio as redis_asyncio
import yaml
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3.external_processor_pb2 import HttpBody, ProcessingRequest, ProcessingResponse
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

from extproc.quota import WINDOW_S
from extproc.tenancy import key_digest
from poolgate.kernel.keys import QuotaKeys
from poolgate.kernel.store import FleetStore
from poolgate.procs import extproc_process
from tests.integration.test_extproc_grpc import CHAT, KEYS, PREFIX, Extproc, body, eventually, headers, record

QUOTA_KEYS = QuotaKeys(PREFIX)


def tenancy_config(**limits: int) -> dict[str, Any]:
    return {
        "key_prefix": PREFIX,
        "pools": [{"name": "chat", "model": "llama"}],
        # w1 is registered once and never heartbeats: starting two extprocs on a loaded machine can take
        # longer than the default staleness bound, which would refuse every request for want of a worker.
        "extproc": {"max_request_bytes": 65536, "snapshot_refresh_s": 0.05, "stale_after_s": 120},
        "tenancy": {"require_api_key": True},
        "tenants": [{"name": "acme", "api_key_sha256": [key_digest("acme-key")], **limits}],
    }


@contextlib.asynccontextmanager
async def two_extprocs(config: dict[str, Any], redis_url: str, tmp: Path) -> AsyncIterator[tuple[Extproc, Extproc]]:
    path = tmp / "poolgate.yaml"
    path.write_text(yaml.safe_dump(config))
    with extproc_process(path, redis_url) as (_, one), extproc_process(path, redis_url) as (_, two):
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in (one, two)]
        try:
            yield (Extproc(ExternalProcessorStub(channels[0]), one), Extproc(ExternalProcessorStub(channels[1]), two))
        finally:
            for channel in channels:
                await channel.close()


@pytest.fixture()
async def redis_client(redis_url: str) -> AsyncIterator[Any]:
    client = redis_asyncio.Redis.from_url(redis_url)
    await FleetStore(client, KEYS.prefix).register(record("w1", 9001), ttl_s=60)
    yield client
    await client.aclose()


AUTH = {"authorization": "Bearer acme-key"}


async def open_request(extproc: Extproc, data: object = CHAT) -> tuple[grpc.aio.StreamStreamCall, ProcessingResponse]:
    call = extproc.stub.Process()
    await call.write(headers("POST", "/v1/chat/completions", extra=AUTH))
    await call.read()
    await call.write(body(data))
    return call, await call.read()


def refusal(answer: ProcessingResponse) -> tuple[int, str | None, bytes]:
    reply = answer.immediate_response
    sent = {h.header.key: h.header.raw_value for h in reply.headers.set_headers}
    return reply.status.code, orjson.loads(reply.body)["error"]["param"], sent.get("retry-after", b"")


async def test_concurrency_limit_holds_across_two_processes(redis_url: str, redis_client: Any, tmp_path: Path) -> None:
    async with two_extprocs(tenancy_config(max_concurrent=3), redis_url, tmp_path) as (one, two):
        open_calls = []
        for extproc in (one, two, one):
            call, answer = await open_request(extproc)
            assert answer.request_body.response.clear_route_cache
            open_calls.append(call)
        for extproc in (one, two):
            _, answer = await open_request(extproc)
            status, limit, retry = refusal(answer)
            assert (status, limit) == (429, "max_concurrent") and int(retry) >= 1
        open_calls[0].cancel()  # one request ends: its slot is released (asynchronously, one script call)

        async def admitted_again() -> bool:
            call, answer = await open_request(two)
            call.cancel()
            return answer.HasField("request_body")

        await eventually(admitted_again)
        for call in open_calls[1:]:
            call.cancel()
        await eventually(lambda: _card(redis_client, QUOTA_KEYS.concurrent("acme"), 0))


async def _card(client: Any, key: str, expected: int) -> bool:
    return int(await client.zcard(key)) == expected


async def test_requests_per_minute_hold_across_two_processes(redis_url: str, redis_client: Any,
                                                             tmp_path: Path) -> None:
    if time.time() % WINDOW_S > WINDOW_S - 5:  # keep the whole test inside one minute window
        await _sleep_to_next_window()
    async with two_extprocs(tenancy_config(requests_per_minute=6), redis_url, tmp_path) as (one, two):
        outcomes = []
        for index in range(10):
            answers = await (one if index % 2 else two).exchange(
                headers("POST", "/v1/chat/completions", extra=AUTH), body(CHAT))
            outcomes.append(answers[-1])
    routed = [a for a in outcomes if a.HasField("request_body")]
    refused = [refusal(a) for a in outcomes if a.HasField("immediate_response")]
    assert len(routed) == 6, refused
    assert refused and all(status == 429 and limit == "requests_per_minute" and int(retry) >= 1
                           for status, limit, retry in refused)


async def _sleep_to_next_window() -> None:
    await asyncio.sleep(WINDOW_S - time.time() % WINDOW_S + 0.1)


def response_chunk(data: bytes, end: bool) -> ProcessingRequest:
    return ProcessingRequest(response_body=HttpBody(body=data, end_of_stream=end))


async def test_tokens_are_reconciled_from_the_reported_usage(redis_url: str, redis_client: Any,
                                                             tmp_path: Path) -> None:
    if time.time() % WINDOW_S > WINDOW_S - 5:
        await _sleep_to_next_window()
    streaming = {**CHAT, "max_tokens": 1000, "stream": True}
    async with two_extprocs(tenancy_config(tokens_per_minute=100_000), redis_url, tmp_path) as (one, _):
        call = one.stub.Process()
        await call.write(headers("POST", "/v1/chat/completions", extra=AUTH))
        first = await call.read()
        assert first.mode_override.response_body_mode == ProcessingMode.STREAMED  # for this request only
        await call.write(body(streaming))
        routed = await call.read()
        common = routed.request_body.response
        sent = orjson.loads(common.body_mutation.body)
        assert sent["stream_options"] == {"include_usage": True}  # asked on the client's behalf
        assert {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}[
            "content-length"] == str(len(common.body_mutation.body)).encode()
        window = int(time.time() // WINDOW_S)
        reserved = int(await redis_client.get(QUOTA_KEYS.tokens("acme", window)) or 0)
        assert reserved > 1000
        content = b'data: {"choices":[{"delta":{"content":"hi"}}],"usage":null}\n\n'
        usage = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":41,"total_tokens":50}}\n\n'
        await call.write(response_chunk(content, False))
        assert not (await call.read()).response_body.HasField("response")  # unchanged
        await call.write(response_chunk(usage + b"data: [DONE]\n\n", True))
        hidden = await call.read()
        assert hidden.response_body.response.body_mutation.body == b"data: [DONE]\n\n"  # the client did not ask
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF

        async def charged(expected: int) -> bool:
            return int(await redis_client.get(QUOTA_KEYS.tokens("acme", window)) or 0) == expected

        await eventually(lambda: charged(50))
