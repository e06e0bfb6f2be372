"""LoRA adapters on a simulated worker over real HTTP: the endpoints, /v1/models, serving and the metric."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from agent.vllm_metrics import parse_engine_metrics
from simworker import cli
from tests.conftest import StartSimWorker

MODEL = "sim-llama-3-8b"
StartWorker = Callable[..., Awaitable[str]]


@pytest.fixture()
def start_worker(start_simworker: StartSimWorker) -> StartWorker:
    """A worker started with ``overrides``; its base URL."""
    async def start(**overrides: Any) -> str:
        worker = await start_simworker(**overrides)
        return f"http://127.0.0.1:{worker.spec.port}"

    return start


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with session.post(url, json=body) as response:
        if response.content_type == "application/json":
            return response.status, await response.json()
        return response.status, await response.text()


@pytest.mark.parametrize(("enable_lora", "runtime"), [(False, True), (True, False)])
async def test_load_endpoint_needs_both_switches(start_worker: StartWorker, enable_lora: bool,
                                                 runtime: bool) -> None:
    url = await start_worker(enable_lora=enable_lora, runtime_lora_updating=runtime)
    async with aiohttp.ClientSession() as session:
        status, _ = await post(session, url + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"})
    assert status == 404


async def test_load_serve_unload(start_worker: StartWorker) -> None:
    url = await start_worker(enable_lora=True, runtime_lora_updating=True, max_loras=1, lora_load_s=0.05)
    completion = {"model": "sql", "prompt": "select", "max_tokens": 4}
    async with aiohttp.ClientSession() as session:
        status, body = await post(session, url + "/v1/completions", completion)
        assert status == 404 and body["error"]["code"] == 404
        status, text = await post(session, url + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"})
        assert status == 200 and "sql" in text
        status, body = await post(session, url + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"})
        assert status == 400 and "already" in body["error"]["message"]
        status, body = await post(session, url + "/v1/load_lora_adapter", {"lora_name": "chat", "lora_path": "/a/c"})
        assert status == 400 and "slots" in body["error"]["message"]
        status, body = await post(session, url + "/v1/load_lora_adapter", {"lora_name": "x"})
        assert status == 400 and body["error"]["param"] == "lora_path"
        async with session.get(url + "/v1/models") as response:
            cards = (await response.json())["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None), ("sql", MODEL)]
        status, body = await post(session, url + "/v1/completions", completion)
        assert status == 200 and body["model"] == "sql"
        status, body = await post(session, url + "/v1/unload_lora_adapter", {"lora_name": "chat"})
        assert status == 404 and body["error"]["code"] == 404
        status, _ = await post(session, url + "/v1/unload_lora_adapter", {"lora_name": "sql"})
        assert status == 200
        status, _ = await post(session, url + "/v1/completions", completion)
        assert status == 404


async def test_metric_shows_adapter_of_a_request_in_flight(start_worker: StartWorker) -> None:
    url = await start_worker(enable_lora=True, runtime_lora_updating=True, max_loras=2)
    async with aiohttp.ClientSession() as session:
        await post(session, url + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "/a/sql"})
        request = asyncio.create_task(post(session, url + "/v1/completions", {
            "model": "sql", "prompt": "select", "max_tokens": 2000, "ignore_eos": True}))
        seen: tuple[str, ...] | None = ()
        for _ in range(100):
            async with session.get(url + "/metrics") as response:
                metrics = parse_engine_metrics(await response.text())
            seen = metrics.lora_adapters
            if seen:
                break
            await asyncio.sleep(0.02)
        assert seen == ("sql",) and metrics.max_loras == 2
        status, _ = await request
        assert status == 200
        async with session.get(url + "/metrics") as response:
            assert parse_engine_metrics(await response.text()).lora_adapters == ()


@pytest.mark.parametrize(("env", "expected"), [(None, False), ("True", True), ("0", False)])
def test_cli_reads_the_runtime_switch(monkeypatch: pytest.MonkeyPatch, env: str | None, expected: bool) -> None:
    if env is None:
        monkeypatch.delenv(cli.RUNTIME_LORA_ENV, raising=False)
    else:
        monkeypatch.setenv(cli.RUNTIME_LORA_ENV, env)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    spec, = cli.worker_specs(parser.parse_args(["--enable-lora", "--max-loras", "3", "--lora-load-s", "0.5",
                                                "--max-lora-rank", "64"]))
    assert (spec.enable_lora, spec.max_loras, spec.lora_load_s, spec.runtime_lora_updating, spec.max_lora_rank) == (
        True, 3, 0.5, expected, 64)
    with pytest.raises(ValueError, match="max-loras"):
        cli.worker_specs(parser.parse_args(["--max-loras", "0"]))
    with pytest.raises(ValueError, match="max-lora-rank"):
        cli.worker_specs(parser.parse_args(["--max-lora-rank", "0"]))
