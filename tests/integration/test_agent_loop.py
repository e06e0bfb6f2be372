"""The agent's tick against a real Redis, with scripted /metrics pages, a fake NVML and a manual clock."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from agent.agent import Agent, ScrapeError, configured_gpu_ids, run_agent
from agent.gpu_sources.reading import LOCAL_NODE, GpuReading
from agent.gpus import GpuSample
from poolgate.kernel.config import Config, parse_config
from poolgate.kernel.fleet import WorkerRecord, WorkerState
from poolgate.kernel.keys import RedisKeys
from poolgate.kernel.store import FleetChange, FleetStore
from poolgate.procs import free_port
from tests.manual_clock import ManualClock

CONFIG = parse_config({
    "pools": [{"name": "chat", "model": "m"}],
    "workers": [{"id": "gpu-worker", "pool": "chat", "backend": "vllm", "model_path": "org/m", "gpus": [1]}],
    "controller": {"heartbeat_interval_s": 0.5, "heartbeat_ttl_s": 5.0},
    "agent": {"scrape_interval_s": 0.05},
})
KEYS = RedisKeys("agent-test")


def page(running: int = 0, waiting: int = 0, kv: float = 0.0, prompt: float = 0, ttft_sum: float = 0.0,
         ttft_count: int = 0, prefill_sum: float = 0.0) -> str:
    labels = 'engine="0",model_name="m"'
    return (
        f"vllm:num_requests_running{{{labels}}} {running}\n"
        f"vllm:num_requests_waiting{{{labels}}} {waiting}\n"
        f"vllm:kv_cache_usage_perc{{{labels}}} {kv}\n"
        f'vllm:cache_config_info{{block_size="16",{labels},num_gpu_blocks="1000"}} 1.0\n'
        f"vllm:prompt_tokens_total{{{labels}}} {prompt}\n"
        f"vllm:time_to_first_token_seconds_sum{{{labels}}} {ttft_sum}\n"
        f"vllm:time_to_first_token_seconds_count{{{labels}}} {ttft_count}\n"
        f"vllm:request_prefill_time_seconds_sum{{{labels}}} {prefill_sum}\n"
        "poolgate_sim_gpu_memory_total_bytes 1073741824\n"
        "poolgate_sim_gpu_memory_used_bytes 268435456\n"
    )


class ScriptedSource:
    """``/metrics`` pages by port; a port mapped to None fails like an unreachable worker."""

    def __init__(self) -> None:
        self.pages: dict[int, str | None] = {}
        self.fetched: list[int] = []

    async def fetch(self, host: str, port: int) -> str:
        self.fetched.append(port)
        text = self.pages.get(port)
        if text is None:
            raise ScrapeError("connection refused")
        return text


class StaticGpus:
    """Stands in for NVML on a node with GPUs (none here)."""

    def __init__(self, *samples: GpuSample) -> None:
        self.reading = GpuReading(nodes={LOCAL_NODE: {sample.index: sample for sample in samples}})

    async def read(self) -> GpuReading:
        return self.reading

    async def close(self) -> None:
        pass


async def register(redis_client: aioredis.Redis, worker_id: str, port: int, host: str = "127.0.0.1",
                   node: str = "") -> None:
    record = WorkerRecord(id=worker_id, pool="chat", model="m", host=host, port=port, node=node,
                          state=WorkerState.BUSY)
    await FleetStore(redis_client, KEYS.prefix).register(record, ttl_s=5.0)


async def fleet(redis_client: aioredis.Redis) -> dict[str, WorkerRecord]:
    return {r.id: r for r in await FleetStore(redis_client, KEYS.prefix).read_fleet()}


def make_agent(redis_client: aioredis.Redis, source: ScriptedSource, clock: ManualClock, config: Config = CONFIG,
               **kwargs: object) -> Agent:
    return Agent(FleetStore(redis_client, KEYS.prefix), source, gpu_ids=configured_gpu_ids(config.workers),
                 clock=clock, wall_clock=lambda: clock.now + 5e8, **kwargs)  # type: ignore[arg-type]


async def test_writes_live_facts_of_local_workers_only(redis_client: aioredis.Redis) -> None:
    await register(redis_client, "local", 7001)
    await register(redis_client, "remote", 7002, host="10.99.0.7")
    source, clock = ScriptedSource(), ManualClock(1000.0)
    source.pages = {7001: page(running=2, waiting=1, kv=0.25), 7002: page(running=9)}
    agent = make_agent(redis_client, source, clock)
    await agent.tick()
    assert source.fetched == [7001]
    workers = await fleet(redis_client)
    local = workers["local"]
    assert (local.running, local.waiting, local.kv_usage) == (2, 1, 0.25)
    assert (local.kv_capacity_tokens, local.kv_block_size) == (16000, 16)
    assert (local.gpu_memory_total_mib, local.gpu_memory_free_mib) == (1024.0, 768.0)
    assert local.state == WorkerState.BUSY  # state belongs to the controller
    assert local.metrics_at == clock.now + 5e8
    assert workers["remote"].running == 0


async def test_with_a_node_name_it_serves_the_workers_registered_on_that_node(redis_client: aioredis.Redis) -> None:
    await register(redis_client, "pod-here", 7001, host="10.42.0.7", node="gpu-a")  # a pod IP: not an address of ours
    await register(redis_client, "pod-there", 7002, host="10.42.1.9", node="gpu-b")
    await register(redis_client, "loopback-there", 7003, node="gpu-b")  # its node says where it is, not its address
    await register(redis_client, "unplaced-local", 7004)  # registered without a node: matched by address as before
    await register(redis_client, "unplaced-remote", 7005, host="10.99.0.7")
    source, clock = ScriptedSource(), ManualClock(1000.0)
    source.pages = {port: page(running=1) for port in range(7001, 7006)}
    agent = make_agent(redis_client, source, clock, node="gpu-a")
    await agent.tick()
    assert sorted(source.fetched) == [7001, 7004]
    workers = await fleet(redis_client)
    assert [w for w in sorted(workers) if workers[w].running == 1] == ["pod-here", "unplaced-local"]


async def test_without_a_node_name_it_serves_workers_by_address(redis_client: aioredis.Redis) -> None:
    await register(redis_client, "pod-here", 7001, host="10.42.0.7", node="gpu-a")
    await register(redis_client, "loopback-there", 7003, node="gpu-b")
    await register(redis_client, "unplaced-local", 7004)
    source, clock = ScriptedSource(), ManualClock(1000.0)
    source.pages = {7001: page(), 7003: page(), 7004: page()}
    agent = make_agent(redis_client, source, clock)
    await agent.tick()
    assert sorted(source.fetched) == [7003, 7004]


async def test_announces_only_notable_changes(redis_client: aioredis.Redis) -> None:
    await register(redis_client, "w", 7001)
    source, clock = ScriptedSource(), ManualClock(1000.0)
    agent = make_agent(redis_client, source, clock)
    pubsub = redis_client.pubsub()
    await pubsub.subscribe(KEYS.events)
    await pubsub.get_message(timeout=1)  # the subscribe confirmation
    steps = [(page(kv=0.10, running=1), True), (page(kv=0.12, running=3), False),
             (page(kv=0.20, running=3), True), (page(kv=0.20, waiting=2), True), (page(kv=0.20, waiting=2), False)]
    for text, _ in steps:
        source.pages[7001] = text
        clock.now += 0.25
        await agent.tick()
    messages = []
    while (message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2)) is not None:
        change = FleetChange.parse(message["data"])
        messages.append((change.kind, change.worker_id))
    await pubsub.aclose()
    assert messages == [("update", "w")] * sum(expected for _, expected in steps)
    assert (agent.stats.writes, agent.stats.announcements) == (5, 3)


async def test_rates_reach_redis(redis_client: aioredis.Redis) -> None:
    await register(redis_client, "w", 7001)
    source, clock = ScriptedSource(), ManualClock(1000.0)
    agent = make_agent(redis_client, source, clock)
    source.pages[7001] = page(running=1, prompt=1000, ttft_sum=1.0, ttft_count=10, prefill_sum=0.5)
    await agent.tick()
    clock.now += 0.5
    source.pages[7001] = page(running=1, prompt=3000, ttft_sum=1.6, ttft_count=12, prefill_sum=1.0)
    await agent.tick()
    record = (await fleet(redis_client))["w"]
    assert record.prefill_tokens_per_s == pytest.approx(4000.0)
    assert record.ttft_ewma_s == pytest.approx(0.3)


async def test_failed_scrape_writes_nothing_and_recovers(redis_client: aioredis.Redis) -> None:
    await register(redis_client, "w", 7001)
    source, clock = ScriptedSource(), ManualClock(1000.0)
    agent = make_agent(redis_client, source, clock)
    source.pages[7001] = page(running=4)
    await agent.tick()
    written = (await fleet(redis_client))["w"]
    source.pages[7001] = None
    for _ in range(3):
        clock.now += 0.25
        await agent.tick()
    assert (await fleet(redis_client))["w"] == written  # facts age out by metrics_at instead of being refreshed
    assert agent.stats.scrape_failures == 3
    source.pages[7001] = "<html>bad gateway</html>"
    clock.now += 0.25
    await agent.tick()
    assert agent.stats.scrape_failures == 4
    source.pages[7001] = page(running=1)
    clock.now += 0.25
    await agent.tick()
    assert (await fleet(redis_client))["w"].running == 1


async def test_expired_worker_is_not_resurrected(redis_client: aioredis.Redis) -> None:
    await register(redis_client, "w", 7001)
    source, clock = ScriptedSource(), ManualClock(1000.0)
    source.pages[7001] = page()
    agent = make_agent(redis_client, source, clock)
    await agent.tick()
    await redis_client.delete(KEYS.worker("w"))  # as if its TTL ran out
    clock.now += 0.25
    await agent.tick()
    assert await redis_client.exists(KEYS.worker("w")) == 0
    assert agent.worker_ids == []


async def test_worker_list_and_fleet_refresh(redis_client: aioredis.Redis) -> None:
    await register(redis_client, "remote", 7002, host="10.99.0.7")
    source, clock = ScriptedSource(), ManualClock(1000.0)
    source.pages = {7002: page(), 7003: page()}
    agent = make_agent(redis_client, source, clock, worker_ids=["remote", "later"], fleet_refresh_s=2.0)
    await agent.tick()
    assert agent.worker_ids == ["remote"]
    await register(redis_client, "later", 7003, host="10.99.0.8")
    clock.now += 1.0
    await agent.tick()
    assert agent.worker_ids == ["remote"]  # the fleet is re-read every few seconds, not every tick
    clock.now += 1.0
    await agent.tick()
    assert agent.worker_ids == ["later", "remote"]


async def test_nvml_facts_for_workers_with_known_gpus(redis_client: aioredis.Redis) -> None:
    await register(redis_client, "gpu-worker", 7001)
    await register(redis_client, "sim-worker", 7002)
    gpus = StaticGpus(GpuSample(0, "GPU-0000", 81920.0, 81920.0, 0.0, 0.0),
                      GpuSample(1, "GPU-1111", 81920.0, 10000.0, 71920.0, 0.8))
    source, clock = ScriptedSource(), ManualClock(1000.0)
    source.pages = {7001: page(), 7002: page()}
    agent = make_agent(redis_client, source, clock, gpus=gpus)
    await agent.tick()
    workers = await fleet(redis_client)
    gpu = workers["gpu-worker"]
    assert (gpu.gpu_memory_total_mib, gpu.gpu_memory_free_mib, gpu.gpu_utilization) == (81920.0, 10000.0, 0.8)
    assert workers["sim-worker"].gpu_memory_total_mib == 1024.0  # no GPU ids: the simulated card


async def test_redis_away_does_not_crash_the_tick() -> None:
    client = aioredis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.2)
    agent = make_agent(client, ScriptedSource(), ManualClock(1000.0))
    await agent.tick()
    await agent.tick()
    assert agent.stats.fleet_read_failures == 2
    await client.aclose()


async def test_run_agent_until_stopped(redis_client: aioredis.Redis) -> None:
    await register(redis_client, "w", 7001)
    source = ScriptedSource()
    source.pages[7001] = page(running=3)
    stop = asyncio.Event()
    ready: list[Agent] = []
    task = asyncio.create_task(run_agent(CONFIG, FleetStore(redis_client, KEYS.prefix), stop, source=source,
                                         open_nvml=lambda _: None, ready=ready.append))
    await asyncio.sleep(0.3)
    stop.set()
    stats = await asyncio.wait_for(task, 1.0)
    assert len(ready) == 1
    assert 3 <= stats.ticks <= 8  # 0.05 s period
    assert (await fleet(redis_client))["w"].running == 3


async def test_live_facts_never_keep_an_unheartbeated_worker_alive(redis_url: str) -> None:
    """The agent's writes must not extend a registration: liveness belongs to the registrant."""
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    store = FleetStore(client, "live")
    keys = store.keys
    try:
        record = WorkerRecord(id="w", pool="chat", model="m", host="127.0.0.1", port=1)
        await store.register(record, ttl_s=0.4)
        for _ in range(6):
            await store.update_live("w", kv_usage=0.5)
            await asyncio.sleep(0.1)
        assert await store.read_fleet() == []
        assert not await store.update_live("w", kv_usage=0.5)  # and never recreates it
        assert await client.exists(keys.worker("w")) == 0
    finally:
        await client.aclose()
