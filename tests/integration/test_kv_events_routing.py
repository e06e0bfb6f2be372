"""Precise prefix-cache routing end to end below Envoy: real simulated workers publish vLLM's KV events over
ZMQ, real extproc replicas subscribe to them (records in a real Redis), and picks follow what the caches
really hold. Affinity and pending blocks are switched off, so only the events can steer the picks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import redis.asyncio as aioredis
import yaml
from aiohttp import web
from envoy.service.ext_proc.v3.external_processor_pb2_grpc import ExternalProcessorStub

from controller.registry_api import RegistryApi
from extproc.scheduling import PLUGINS
from poolgate.kernel.config import (
    Config,
    ExtprocSettings,
    KvEventsSettings,
    PoolSpec,
    SchedulingSettings,
    parse_config,
)
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.store import FleetStore
from poolgate.procs import extproc_process, free_port
from simworker.kv_publisher import KVEventsConfig
from simworker.presets import PRESETS
from simworker.worker import SimWorker, WorkerSpec
from tests.integration.test_extproc_grpc import PREFIX, Extproc, body, headers, pin_of, running_extproc

MODEL = "sim-llama-3-8b"
LEDGER_DRAINED_S = 3.0
DOC_A = " ".join(f"alpha{i % 211} section" for i in range(900))
DOC_B = " ".join(f"beta{i % 199} clause" for i in range(900))


def extproc_config() -> Config:
    return Config(
        key_prefix=PREFIX, pools=(PoolSpec(name="chat", model=MODEL, max_model_len=8192),),
        extproc=ExtprocSettings(max_request_bytes=1 << 20, snapshot_refresh_s=0.05, stale_after_s=3600.0,
                                kv_events=KvEventsSettings(pending_s=0.0)),
        scheduling=SchedulingSettings(weights={**PLUGINS.default_weights, "prefix_affinity": 0.0}))


@dataclass
class Running:
    worker: SimWorker
    stop: asyncio.Event
    task: asyncio.Task[None]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.worker.spec.port}"

    async def close(self) -> None:
        self.stop.set()
        await asyncio.wait_for(self.task, 10)


@dataclass(frozen=True)
class Ports:
    http: int
    events: int
    replay: int


StartWorker = Callable[[str, Ports], Awaitable[Running]]


@contextlib.asynccontextmanager
async def workers() -> AsyncIterator[tuple[StartWorker, list[Running]]]:
    running: list[Running] = []

    async def start(worker_id: str, ports: Ports) -> Running:
        events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{ports.events}",
                                replay_endpoint=f"tcp://*:{ports.replay}", topic="kv-events")
        worker = SimWorker(WorkerSpec(port=ports.http, worker_id=worker_id, preset=PRESETS["h100-80gb"],
                                      model_name=MODEL, time_scale=20.0, kv_events=events))
        stop = asyncio.Event()
        task = asyncio.create_task(worker.serve(stop))
        await asyncio.wait_for(worker.listening.wait(), 5)
        running.append(Running(worker, stop, task))
        return running[-1]

    try:
        yield start, running
    finally:
        for item in running:
            if not item.task.done():
                await item.close()


def record(worker_id: str, ports: Ports) -> WorkerRecord:
    return WorkerRecord(id=worker_id, pool="chat", model=MODEL, host="127.0.0.1", port=ports.http, backend="sim",
                        kv_capacity_tokens=500_000, kv_events_endpoint=f"tcp://127.0.0.1:{ports.events}",
                        kv_events_replay_endpoint=f"tcp://127.0.0.1:{ports.replay}")


async def fleet_of(names: list[str], start: StartWorker, redis_client: Any) -> dict[str, Running]:
    fleet: dict[str, Running] = {}
    for name in names:
        ports = Ports(free_port(), free_port(), free_port())
        fleet[name] = await start(name, ports)
        await FleetStore(redis_client, PREFIX).register(record(name, ports), ttl_s=60)
    return fleet


def chat(document: str, question: str = "Summarise it.") -> dict[str, object]:
    return {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": f"{document}\n\n{question}"}]}


async def warm(target: Running, document: str) -> None:
    """Send a prompt straight to one worker (not through extproc): only its KV events can tell extproc."""
    async with aiohttp.ClientSession() as session, session.post(
            f"http://{target.address}/v1/chat/completions", json=chat(document, "First question.")) as response:
        assert response.status == 200


async def pick(extproc: Extproc, data: dict[str, object]) -> str:
    answers = await extproc.exchange(headers("POST", "/v1/chat/completions"), body(data))
    return pin_of(answers[-1]).split(",")[0]


async def settled_pick(extproc: Extproc, data: dict[str, object], redis_client: Any) -> str:
    """A pick once every earlier placement is released in Redis (no replica's reservation or in-flight count
    left: the peers' flush) and a few of the replicas' refreshes later, so each pick meets the same load and
    only the cache decides (polled: on a loaded machine a flush can take far longer than usual)."""
    keys = RedisKeys(PREFIX)
    deadline = time.monotonic() + 30.0
    while True:
        reserved = await redis_client.hkeys(keys.peers.reserved)
        counts = await redis_client.hvals(keys.inflight)
        if not reserved and all(int(c or 0) == 0 for c in counts):
            break
        assert time.monotonic() < deadline, f"placements never released: {reserved} {counts}"
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # the replicas' refreshes (every 0.05 s) read the released state
    return await pick(extproc, data)


async def picked_within(extproc: Extproc, data: dict[str, object], address: str, timeout_s: float = 10.0) -> float:
    """Seconds until extproc picks ``address`` for ``data`` (polled; fails after ``timeout_s``)."""
    started = time.monotonic()
    while await pick(extproc, data) != address:
        assert time.monotonic() - started < timeout_s, f"extproc never picked {address}"
        await asyncio.sleep(0.05)
    return time.monotonic() - started


async def test_picks_follow_what_each_worker_really_caches(redis_url: str, redis_client: Any) -> None:
    async with workers() as (start, _):
        fleet = await fleet_of(["a", "b", "c"], start, redis_client)
        async with running_extproc(redis_url, extproc_config()) as extproc:
            await asyncio.sleep(0.3)  # subscriptions joined
            await warm(fleet["b"], DOC_A)
            await warm(fleet["c"], DOC_B)
            waited = await picked_within(extproc, chat(DOC_A), fleet["b"].address)
            print(f"extproc followed b's cache {waited:.2f} s after the warm-up answered")
            assert [await pick(extproc, chat(DOC_A, f"Question {i}?")) for i in range(6)] == [fleet["b"].address] * 6
            assert [await pick(extproc, chat(DOC_B, f"Question {i}?")) for i in range(6)] == [fleet["c"].address] * 6


@contextlib.asynccontextmanager
async def extproc_processes(count: int, redis_url: str, directory: Path) -> AsyncIterator[list[Extproc]]:
    """``count`` ``poolgate extproc`` processes, each with its own subscriptions and index."""
    config = extproc_config()
    path = directory / "poolgate.yaml"
    path.write_text(yaml.safe_dump({
        "key_prefix": config.key_prefix, "pools": [{"name": "chat", "model": MODEL, "max_model_len": 8192}],
        "extproc": {"max_request_bytes": 1 << 20, "snapshot_refresh_s": 0.05, "stale_after_s": 3600.0,
                    "kv_events": {"pending_s": 0.0}},
        "scheduling": {"weights": dict(config.scheduling.weights)}}))
    with contextlib.ExitStack() as stack:
        ports = [(await asyncio.to_thread(stack.enter_context, extproc_process(path, redis_url)))[1]
                 for _ in range(count)]
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in ports]
        try:
            yield [Extproc(ExternalProcessorStub(channel), port) for channel, port in zip(channels, ports, strict=True)]
        finally:
            for channel in channels:
                await channel.close()
            await asyncio.to_thread(stack.close)


async def test_two_extproc_processes_pick_alike_from_the_same_event_streams(
        redis_url: str, redis_client: Any, tmp_path: Path) -> None:
    async with workers() as (start, _):
        fleet = await fleet_of(["a", "b", "c"], start, redis_client)
        await warm(fleet["a"], DOC_B)  # before either process exists: they learn it from the replay buffer
        async with extproc_processes(2, redis_url, tmp_path) as (first, second):
            await warm(fleet["c"], DOC_A)
            for replica in (first, second):
                await picked_within(replica, chat(DOC_A), fleet["c"].address, timeout_s=20.0)
            # The polls above placed the document (whole, where its blocks were not known yet) while the
            # processes joined the streams; each process's ledger drains those prefills at the default rate
            # (8,000 tokens a second) from when it read them, and one that still counted them would send the
            # next question elsewhere. (It entered them at its next pick, as if placed then: 1 run in 10 failed.)
            await asyncio.sleep(LEDGER_DRAINED_S)
            prompts = [chat(doc, f"Question {i}?") for i in range(4) for doc in (DOC_A, DOC_B)]
            picks_first, picks_second = [], []
            for prompt in prompts:  # interleaved, so both meet the same load and only the cache decides
                picks_first.append(await settled_pick(first, prompt, redis_client))
                picks_second.append(await settled_pick(second, prompt, redis_client))
    assert picks_first == picks_second
    assert picks_first == [fleet["c"].address, fleet["a"].address] * 4


async def test_a_restarted_worker_stops_attracting_its_old_prefixes_at_its_first_batch(
        redis_url: str, redis_client: Any) -> None:
    async with workers() as (start, running):
        fleet = await fleet_of(["a", "b"], start, redis_client)
        async with running_extproc(redis_url, extproc_config()) as extproc:
            await asyncio.sleep(0.3)
            await warm(fleet["b"], DOC_A)
            await picked_within(extproc, chat(DOC_A), fleet["b"].address)
            spec = fleet["b"].worker.spec
            await fleet["b"].close()
            restarted = await start("b", Ports(spec.port, *_event_ports(spec)))  # same record, empty cache
            await warm(fleet["a"], DOC_A)  # a now holds the prefix; b's first batch is about something else
            await warm(restarted, DOC_B)
            waited = await picked_within(extproc, chat(DOC_A), fleet["a"].address)
            print(f"restart noticed {waited:.2f} s after b's first batch")
            assert [await pick(extproc, chat(DOC_A, f"Question {i}?")) for i in range(6)] == [fleet["a"].address] * 6
        assert len(running) == 3


def _event_ports(spec: WorkerSpec) -> tuple[int, int]:
    assert spec.kv_events.replay_endpoint is not None
    return (int(spec.kv_events.endpoint.rpartition(":")[2]), int(spec.kv_events.replay_endpoint.rpartition(":")[2]))


async def test_a_worker_registers_where_it_publishes_and_bad_endpoints_are_refused(redis_url: str) -> None:
    redis = aioredis.from_url(redis_url)
    config = parse_config({"pools": [{"name": "chat", "model": MODEL}]})
    runner = web.AppRunner(RegistryApi(FleetStore(redis, "kv"), "token", config.pools, config.controller).app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    worker = {"id": "w1", "pool": "chat", "host": "127.0.0.1", "port": 9001,
              "kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:5558"}
    try:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer token"}) as http:
            async with http.post(f"{base}/v1/workers", json=worker) as response:
                assert response.status == 201
            async with http.post(f"{base}/v1/workers", json={**worker, "id": "w2",
                                                              "kv_events_endpoint": "http://x"}) as response:
                assert response.status == 400
        [record] = await FleetStore(redis, "kv").read_fleet()
        assert (record.kv_events_endpoint, record.kv_events_replay_endpoint) == (
            "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    finally:
        await runner.cleanup()
        await redis.aclose()
