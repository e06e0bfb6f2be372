"""GPU facts from dcgm-exporter pages and from a real Prometheus server reach the fleet in Redis.

The exporters are stand-ins (``tests/standin_dcgm_exporter.py``) for GPU nodes these machines do not
have; Prometheus is the real server (Debian package ``prometheus``, installed by ``make setup``), started
here on a free port with a config that scrapes them. Worker ``/metrics`` pages are scripted.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
import redis.asyncio as aioredis
import yaml

from agent.agent import Agent, run_agent
from poolgate.kernel.config import Config, parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore
from poolgate.procs import free_port, stop_process
from tests.standin_dcgm_exporter import StandInDcgmExporter, StandInGpu

PREFIX = "gpu-sources"
SCRAPE_INTERVAL_S = 0.1
PROMETHEUS_SCRAPE = "200ms"
PAGE = ('vllm:num_requests_running{engine="0",model_name="m"} 1\n'
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n')


class Pages:
    """Every worker's ``/metrics`` answers the same small engine page."""

    async def fetch(self, host: str, port: int) -> str:
        return PAGE


def node_a() -> list[StandInGpu]:
    return [StandInGpu(0, "GPU-a0", 30000, 50000, 70, pods=[("poolgate", "pg-chat-1")]),
            StandInGpu(1, "GPU-a1", 80000, 0, 0)]


def node_b() -> list[StandInGpu]:
    return [StandInGpu(0, "GPU-b0", 10000, 70000, 95), StandInGpu(1, "GPU-b1", 60000, 20000, 40)]


def make_config(agent: dict[str, object]) -> Config:
    return parse_config({
        "pools": [{"name": "chat", "model": "m"}],
        "workers": [{"id": "b-1", "pool": "chat", "backend": "vllm", "model_path": "org/m", "gpus": [1]}],
        "agent": {"scrape_interval_s": SCRAPE_INTERVAL_S, **agent},
    })


@pytest.fixture()
async def exporters() -> AsyncIterator[tuple[StandInDcgmExporter, StandInDcgmExporter]]:
    a, b = StandInDcgmExporter("gpu-node-a", node_a()), StandInDcgmExporter("gpu-node-b", node_b())
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()


class PrometheusServer:
    """A real Prometheus on a free port of 127.0.0.1, scraping ``targets`` every 200 ms, data in a temp dir."""

    def __init__(self, targets: list[str]) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("the prometheus binary is not installed: `make setup` installs it (Debian package "
                        "prometheus); these tests need a real Prometheus server")
        self.dir = Path(tempfile.mkdtemp(prefix="poolgate-prometheus-"))
        config = {"global": {"scrape_interval": PROMETHEUS_SCRAPE, "scrape_timeout": PROMETHEUS_SCRAPE},
                  "scrape_configs": [{"job_name": "dcgm-exporter", "honor_labels": True,
                                      "static_configs": [{"targets": targets}]}]}
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (self.dir / "prometheus.log").open("wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.dir / 'prometheus.yml'}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"], stdout=self.log, stderr=subprocess.STDOUT)

    async def ready(self, session: aiohttp.ClientSession, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"prometheus exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                async with session.get(f"{self.url}/-/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        pytest.fail(f"prometheus not ready within {timeout_s} s: {self.log_tail()}")

    def log_tail(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")[-2000:]

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class QueryClient:
    """The test's own queries of Prometheus, counted so the agent's can be told apart."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url, self.sent = session, url, 0

    async def value(self, query: str) -> float | None:
        self.sent += 1
        async with self.session.get(f"{self.url}/api/v1/query", params={"query": query}) as response:
            result = (await response.json())["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    async def query_requests(self) -> float:
        """Answered ``/api/v1/query`` requests, from Prometheus's own metrics."""
        async with self.session.get(f"{self.url}/metrics") as response:
            text = await response.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("prometheus_http_requests_total{") and 'handler="/api/v1/query"' in line)


@pytest.fixture()
async def prometheus(exporters: tuple[StandInDcgmExporter, StandInDcgmExporter]
                     ) -> AsyncIterator[QueryClient]:
    server = PrometheusServer([f"127.0.0.1:{e.port}" for e in exporters])
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            await server.ready(session)
            yield QueryClient(session, server.url)
    finally:
        server.stop()


async def register(redis_client: aioredis.Redis, worker_id: str, node: str) -> None:
    record = WorkerRecord(id=worker_id, pool="chat", model="m", host="10.42.0.9", port=8000, node=node)
    await FleetStore(redis_client, PREFIX).register(record, ttl_s=30.0)


async def free_mib(redis_client: aioredis.Redis) -> dict[str, float]:
    return {r.id: r.gpu_memory_free_mib for r in await FleetStore(redis_client, PREFIX).read_fleet()}


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Seconds until ``check`` holds, polled every 10 ms; fails after ``timeout_s`` (a generous bound)."""
    started = time.monotonic()
    while not await check():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def start_agent(config: Config, redis_client: aioredis.Redis, workers: list[str]
                      ) -> tuple[asyncio.Task[object], asyncio.Event, list[Agent]]:
    stop, ready = asyncio.Event(), []
    # by-uuid's GPU as CUDA_VISIBLE_DEVICES would name it
    store = FleetStore(redis_client, PREFIX)
    task = asyncio.create_task(run_agent(config, store, stop, worker_ids=workers, source=Pages(),
                                         gpu_ids={"by-uuid": ["GPU-b0"]}, ready=ready.append))
    return task, stop, ready  # type: ignore[return-value]


async def test_dcgm_exporter_facts_reach_the_fleet(redis_client: aioredis.Redis,
                                                   exporters: tuple[StandInDcgmExporter, StandInDcgmExporter]
                                                   ) -> None:
    exporter, _ = exporters
    config = make_config({"gpu_source": "dcgm", "dcgm": {"url": exporter.url, "interval_s": SCRAPE_INTERVAL_S}})
    await register(redis_client, "pg-chat-1", node="gpu-node-a")  # by the exporter's pod labels
    await register(redis_client, "b-1", node="gpu-node-a")  # by its configured GPU index on this node
    task, stop, _ = await start_agent(config, redis_client, ["pg-chat-1", "b-1"])
    try:
        await until(lambda: _equals(redis_client, {"pg-chat-1": 30000.0, "b-1": 80000.0}), 10.0, "first facts")
        [record] = [r for r in await FleetStore(redis_client, PREFIX).read_fleet() if r.id == "pg-chat-1"]
        assert (record.gpu_memory_total_mib, record.gpu_utilization) == (30000 + 50000 + 512, 0.7)

        exporter.gpus[0].free_mib = 12345
        took = await until(lambda: _equals(redis_client, {"pg-chat-1": 12345.0}), 5.0, "a changed page")
        print(f"dcgm-exporter page → fleet record: {took:.3f} s (agent interval {SCRAPE_INTERVAL_S} s)")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5.0)


async def test_prometheus_facts_reach_the_fleet_with_one_query_per_interval(
        redis_client: aioredis.Redis, exporters: tuple[StandInDcgmExporter, StandInDcgmExporter],
        prometheus: QueryClient) -> None:
    exporter_a, exporter_b = exporters
    query_interval_s = 0.2
    config = make_config({"gpu_source": "prometheus", "prometheus": {
        "url": prometheus.url, "selector": 'job="dcgm-exporter"', "interval_s": query_interval_s}})
    await register(redis_client, "pg-chat-1", node="gpu-node-a")  # pod labels, through Prometheus
    await register(redis_client, "b-1", node="gpu-node-b")  # index 1 on node b, not node a's GPU 1
    await register(redis_client, "by-uuid", node="")  # a UUID needs no node
    await until(lambda: _scraped(prometheus, 'DCGM_FI_DEV_FB_FREE{Hostname="gpu-node-b",gpu="1"}', 60000.0),
                30.0, "Prometheus scraping the stand-in exporters")
    before = await prometheus.query_requests() - prometheus.sent
    started = time.monotonic()
    task, stop, ready = await start_agent(config, redis_client, ["pg-chat-1", "b-1", "by-uuid"])
    try:
        await until(lambda: _equals(redis_client, {"pg-chat-1": 30000.0, "b-1": 60000.0, "by-uuid": 10000.0}),
                    10.0, "first facts from Prometheus")

        exporter_b.gpus[1].free_mib = 4321
        seen = await until(lambda: _scraped(prometheus, 'DCGM_FI_DEV_FB_FREE{Hostname="gpu-node-b",gpu="1"}',
                                            4321.0), 10.0, "Prometheus seeing the change")
        took = await until(lambda: _equals(redis_client, {"b-1": 4321.0}), 5.0, "the change reaching the fleet")
        print(f"exporter → Prometheus: {seen:.3f} s (scrape {PROMETHEUS_SCRAPE}); Prometheus → fleet record: "
              f"{took:.3f} s (query interval {query_interval_s} s, agent interval {SCRAPE_INTERVAL_S} s)")
        assert exporter_a.scrapes > 0
        await asyncio.sleep(1.0)  # a window in which to count the agent's queries
    finally:
        stop.set()
        stats = await asyncio.wait_for(task, 5.0)
    elapsed = time.monotonic() - started
    agent_queries = await prometheus.query_requests() - prometheus.sent - before
    print(f"{agent_queries:.0f} agent queries in {elapsed:.2f} s over {stats.ticks} ticks for 3 workers")
    assert len(ready) == 1
    assert 1 <= agent_queries <= elapsed / query_interval_s + 2  # one per interval for the fleet, not per worker
    assert stats.ticks > agent_queries


async def _equals(redis_client: aioredis.Redis, expected: dict[str, float]) -> bool:
    current = await free_mib(redis_client)
    return all(current.get(worker) == value for worker, value in expected.items())


async def _scraped(prometheus: QueryClient, query: str, value: float) -> bool:
    return await prometheus.value(query) == value
