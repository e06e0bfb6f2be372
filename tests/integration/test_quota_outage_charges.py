"""Quota charges of requests admitted while Redis was away (fail-open) are written once it is back, once.

First the write itself on a real Redis (a resent batch counts once; a bucket that left the window is not
charged, its minute's accounting counter is; admissions after it see the charge), then a real extproc
process under requests whose redis-server is killed and started again: once Redis is back, the tenant's
request counters equal the requests extproc admitted, within the stated bound (an admission executed by
Redis whose reply was lost at the kill counts twice: at most one per caller).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis.asyncio as redis_asyncio
import yaml
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

from bench.redis_deployments import RedisServer
from extproc.errors import ApiError
from extproc.quota import WINDOW_S, QuotaStore
from extproc.quota_backlog import Charge, ChargeBatch
from extproc.tenancy import Tenant, key_digest
from poolgate.kernel.keys import QuotaKeys
from poolgate.kernel.store import FleetStore
from poolgate.procs import extproc_process
from tests.integration.test_extproc_grpc import CHAT, PREFIX, Extproc, body, headers, record
from tests.manual_clock import ManualClock

KEYS = QuotaKeys(PREFIX)
NOW = 1_000_030.5
"""Half a minute into calendar minute 16,667, on the store's injected clock."""
CALLERS = 6
OUTAGE_S = 2.0
WRITTEN_BOUND_S = 30.0
"""Generous, for a loaded machine: the kept charges are written within about a retry period (0.5 s) of
Redis answering again; the time is printed."""


def metered(**limits: int) -> Tenant:
    return Tenant("acme", priority=1, priority_class="standard", **limits)  # type: ignore[arg-type]


async def bucket_sum(client: Any, key: str) -> int:
    return sum(int(v) for v in await client.hvals(key))


async def test_a_resent_batch_counts_once_and_later_admissions_see_it(redis_client: Any) -> None:
    quotas = QuotaStore(redis_client, KEYS, lease_s=30.0, clock=ManualClock(NOW))
    now = int(NOW)
    old = now - WINDOW_S - 5  # out of the admission window, still in the previous minute's counter
    batch = ChargeBatch("acme", "proc:1", (Charge(old, 2, 300), Charge(now, 3, 500)), requests=5)
    assert await quotas.write_charges(batch)
    assert not await quotas.write_charges(batch), "a batch sent again (its reply lost) was applied again"
    assert {int(k): int(v) for k, v in (await redis_client.hgetall(KEYS.request_buckets("acme"))).items()} == {now: 3}
    assert {int(k): int(v) for k, v in (await redis_client.hgetall(KEYS.token_buckets("acme"))).items()} == {now: 500}
    assert int(await redis_client.get(KEYS.tokens("acme", now // 60))) == 500
    assert int(await redis_client.get(KEYS.tokens("acme", old // 60))) == 300
    assert await redis_client.pttl(KEYS.tokens("acme", old // 60)) > 0, "a minute counter it made never expires"
    refused = await quotas.admit(metered(requests_per_minute=3), 10)
    assert isinstance(refused, ApiError) and refused.param == "requests_per_minute", refused
    admitted = await quotas.admit(metered(requests_per_minute=4), 10)
    assert not isinstance(admitted, ApiError)


@pytest.fixture()
def durable_redis() -> Iterator[RedisServer]:
    server = RedisServer(durable=True)
    try:
        yield server
    finally:
        server.stop()


def quota_config() -> dict[str, Any]:
    return {
        "key_prefix": PREFIX,
        "pools": [{"name": "chat", "model": "llama"}],
        # w1 is registered once: the snapshot must keep it through the outage and a loaded start.
        "extproc": {"max_request_bytes": 65536, "snapshot_refresh_s": 0.05, "stale_after_s": 120},
        "tenancy": {"require_api_key": True, "quota_fail_open": True},
        "tenants": [{"name": "acme", "api_key_sha256": [key_digest("acme-key")], "requests_per_minute": 10**9}],
    }


async def _send_loop(extproc: Extproc, admitted: list[float], refused: list[str], stop: asyncio.Event) -> None:
    while not stop.is_set():
        answers = await extproc.exchange(headers("POST", "/v1/chat/completions",
                                                 extra={"authorization": "Bearer acme-key"}), body(CHAT))
        if answers[-1].HasField("request_body"):
            admitted.append(time.monotonic())
        else:
            refused.append(str(answers[-1].immediate_response.status.code))
        await asyncio.sleep(0.01)


async def test_charges_made_while_redis_was_killed_are_written_once_it_is_back(
        durable_redis: RedisServer, tmp_path: Path) -> None:
    client = redis_asyncio.Redis.from_url(durable_redis.url)
    await FleetStore(client, PREFIX).register(record("w1", 9001), ttl_s=600)
    await client.aclose()  # its connection dies with the server; the counters are read with a new one
    path = tmp_path / "poolgate.yaml"
    path.write_text(yaml.safe_dump(quota_config()))
    admitted: list[float] = []
    refused: list[str] = []
    stop = asyncio.Event()
    client = None
    try:
        with extproc_process(path, durable_redis.url) as (_, port):
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            extproc = Extproc(ExternalProcessorStub(channel), port)
            loops = [asyncio.create_task(_send_loop(extproc, admitted, refused, stop)) for _ in range(CALLERS)]
            try:
                await asyncio.sleep(1.0)
                durable_redis.kill()
                killed_at = time.monotonic()
                await asyncio.sleep(OUTAGE_S)
                durable_redis.start()
                back_at = time.monotonic()
                await asyncio.sleep(1.0)  # requests go on after Redis is back
            finally:
                stop.set()
                await asyncio.gather(*loops)
                await channel.close()
            during = sum(killed_at <= t <= back_at for t in admitted)
            client = redis_asyncio.Redis.from_url(durable_redis.url)
            written_at = None
            while time.monotonic() - back_at < WRITTEN_BOUND_S:
                counted = await bucket_sum(client, KEYS.request_buckets("acme"))
                if counted >= len(admitted):
                    written_at = time.monotonic()
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # nothing more comes
            counted = await bucket_sum(client, KEYS.request_buckets("acme"))
    finally:
        if client is not None:
            await client.aclose()
    print(f"\nadmitted {len(admitted)} requests ({during} while Redis was away, {OUTAGE_S:g} s), refused "
          f"{len(refused)}; counted {counted}; the kept charges were written "
          + (f"{written_at - back_at:.2f} s after Redis was back" if written_at else "never"))
    assert refused == [], "fail-open quotas refused requests"
    assert during > 0, "no request was admitted while Redis was away: the test did not test the outage"
    assert len(admitted) <= counted <= len(admitted) + CALLERS, (
        f"counted {counted} for {len(admitted)} admissions (bound: at most {CALLERS} counted twice)")
