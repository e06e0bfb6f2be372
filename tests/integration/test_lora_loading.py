"""The controller's adapter loader against real simulated workers registered in a real Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
import redis.asyncio as aioredis

from controller.adapters import AdapterLoader, run_adapter_loader
from poolgate.kernel.config import LoraAdapter
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore
from poolgate.procs import free_port
from simworker.presets import PRESETS
from simworker.worker import SimWorker, WorkerSpec

MODEL = "sim-llama-3-8b"
SQL = LoraAdapter(name="sql", base=MODEL, path="/adapters/sql")


@pytest.fixture()
async def fleet(redis_url: str) -> AsyncIterator[tuple[FleetStore, dict[str, str]]]:
    """Three workers: one taking adapters, one whose only slot holds another adapter, one without LoRA."""
    redis = aioredis.from_url(redis_url)
    store = FleetStore(redis, "loratest")
    stop = asyncio.Event()
    specs = {"roomy": {"enable_lora": True, "runtime_lora_updating": True, "lora_load_s": 0.05},
             "full": {"enable_lora": True, "runtime_lora_updating": True, "max_loras": 1},
             "plain": {}}
    urls: dict[str, str] = {}
    tasks = []
    for worker_id, extra in specs.items():
        port = free_port()
        worker = SimWorker(WorkerSpec(port=port, worker_id=worker_id, preset=PRESETS["h100-80gb"],
                                      time_scale=20.0, **extra))  # type: ignore[arg-type]
        tasks.append(asyncio.create_task(worker.serve(stop)))
        await asyncio.wait_for(worker.listening.wait(), 5)
        await store.register(WorkerRecord(id=worker_id, pool="p", model=MODEL, host="127.0.0.1", port=port,
                                          updated_at=0.0), ttl_s=30)
        urls[worker_id] = f"http://127.0.0.1:{port}"
    async with aiohttp.ClientSession() as session, session.post(
            urls["full"] + "/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": "/a/o"}) as response:
        assert response.status == 200
    yield store, urls
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    await redis.aclose()


async def test_missing_adapter_gets_loaded_and_served(fleet: tuple[FleetStore, dict[str, str]]) -> None:
    store, urls = fleet
    completion = {"model": "sql", "prompt": "select 1", "max_tokens": 4}
    async with aiohttp.ClientSession() as session:
        async with session.post(urls["roomy"] + "/v1/completions", json=completion) as response:
            assert response.status == 404  # not loaded yet
        follower = AdapterLoader([SQL], store, session, is_leader=lambda: False)
        assert await follower.sync_once() == []
        loader = AdapterLoader([SQL], store, session, is_leader=lambda: True)
        assert await loader.sync_once() == [("roomy", "sql")]  # "full" refuses, "plain" has no endpoint
        assert await loader.sync_once() == []  # already there: nothing to do
        async with session.post(urls["roomy"] + "/v1/completions", json=completion) as response:
            assert response.status == 200
            assert (await response.json())["model"] == "sql"


async def test_loader_task_reloads_after_an_unload(fleet: tuple[FleetStore, dict[str, str]]) -> None:
    store, urls = fleet
    stop = asyncio.Event()
    async with aiohttp.ClientSession() as session:
        loader = AdapterLoader([SQL], store, session, is_leader=lambda: True)
        task = asyncio.create_task(run_adapter_loader(loader, 0.05, stop))
        try:
            for _ in range(2):
                for _ in range(100):
                    async with session.get(urls["roomy"] + "/v1/models") as response:
                        if "sql" in {card["id"] for card in (await response.json())["data"]}:
                            break
                    await asyncio.sleep(0.05)
                else:
                    pytest.fail("the adapter was never loaded")
                async with session.post(urls["roomy"] + "/v1/unload_lora_adapter", json={"lora_name": "sql"}) as r:
                    assert r.status == 200  # as after a restart: the next pass must load it again
        finally:
            stop.set()
            await asyncio.wait_for(task, 5)
