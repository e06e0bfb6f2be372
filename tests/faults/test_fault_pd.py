"""The prefill/decode sidecar's failure paths, against real simulated workers over HTTP (no Envoy: the pair
headers are what extproc would set): a dead prefill worker, a decode worker that fails before its first
token, transfer params that expired, and no decode worker at all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from extproc.sidecar import PD_HEADER, PdSidecar
from poolgate.kernel.routing import DECODE_HEADER, PREFILL_HEADER, WORKER_HEADER
from poolgate.procs import free_port
from simworker.faults import FaultSettings
from simworker.kv_transfer import KVTransferConfig
from simworker.worker import SimWorker
from tests.conftest import StartSimWorker

MODEL = "sim-llama-3-8b"
LONG_PROMPT = "summarise this report " * 800
Start = Callable[..., Awaitable[SimWorker]]


def kv(role: str, abort_timeout_s: float = 480.0) -> KVTransferConfig:
    return KVTransferConfig("NixlConnector", role, abort_timeout_s=abort_timeout_s)  # type: ignore[arg-type]


@pytest.fixture()
def start_worker(start_simworker: StartSimWorker) -> Start:
    """A worker of a KV-transfer role at 10× real speed, its id ``ROLE-PORT``."""
    async def start(role: str, **overrides: Any) -> SimWorker:
        port = free_port()
        return await start_simworker(**{"port": port, "worker_id": f"{role}-{port}", "time_scale": 10.0,
                                        "kv_transfer": kv(role), **overrides})

    return start


@pytest.fixture()
async def sidecar() -> AsyncIterator[tuple[str, PdSidecar]]:
    proxy = PdSidecar(step_timeout_s=1.0)
    runner = web.AppRunner(proxy.build_app(), shutdown_timeout=0.5)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", proxy
    await runner.cleanup()


def address(worker: SimWorker) -> str:
    return f"127.0.0.1:{worker.spec.port}"


async def ask(base: str, prefill: list[str], decode: list[str], stream: bool = True,
              max_tokens: int = 12) -> tuple[int, dict[str, str], bytes]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": max_tokens,
            "stream": stream}
    headers = {PREFILL_HEADER: ",".join(prefill), DECODE_HEADER: ",".join(decode)}
    async with aiohttp.ClientSession() as session, session.post(f"{base}/v1/chat/completions", json=body,
                                                                headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


def split_of(headers: dict[str, str]) -> dict[str, str]:
    return dict(part.split("=", 1) for part in headers[PD_HEADER].split())


def content(raw: bytes) -> str:
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    assert all("error" not in event for event in events)
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


def counter(proxy: PdSidecar, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(generate_latest(proxy.metrics.registry).decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def test_split_request_streams_from_the_decode_worker(start_worker: Start,
                                                           sidecar: tuple[str, PdSidecar]) -> None:
    base, proxy = sidecar
    prefill, decode = await start_worker("kv_producer"), await start_worker("kv_consumer")
    status, headers, raw = await ask(base, [address(prefill)], [address(decode)])
    assert status == 200 and headers[WORKER_HEADER] == decode.spec.worker_id
    split = split_of(headers)
    assert split["prefill"] == address(prefill) and split["decode"] == address(decode)
    assert split["fallback"] == "-" and int(split["kv_tokens"]) > 3000
    assert content(raw)
    assert prefill.kv_transfer_held() == 0  # the decode worker read the KV and said done
    status, headers, raw = await ask(base, [address(prefill)], [address(decode)], stream=False)
    answer = orjson.loads(raw)
    assert status == 200 and answer["usage"]["completion_tokens"] == 12 and "kv_transfer_params" not in answer
    assert counter(proxy, "poolgate_pd_requests_total", outcome="split") == 2


async def test_dead_prefill_worker_is_replaced_before_anything_reaches_the_client(
        start_worker: Start, sidecar: tuple[str, PdSidecar]) -> None:
    base, proxy = sidecar
    crashed = await start_worker("kv_producer", enable_fault_api=True)
    crashed.crash("test: prefill worker dies")
    alive, decode = await start_worker("kv_producer"), await start_worker("kv_consumer")
    gone = f"127.0.0.1:{free_port()}"  # nothing listens: connection refused
    status, headers, raw = await ask(base, [gone, address(crashed), address(alive)], [address(decode)])
    assert status == 200 and split_of(headers)["prefill"] == address(alive) and content(raw)
    assert counter(proxy, "poolgate_pd_retries_total", step="prefill") == 2
    # no prefill worker left at all: the decode worker serves it as an ordinary request
    status, headers, raw = await ask(base, [gone], [address(decode)])
    assert status == 200 and split_of(headers)["fallback"] == "no_prefill" and content(raw)


async def test_decode_worker_failing_before_its_first_token_is_replaced(
        start_worker: Start, sidecar: tuple[str, PdSidecar]) -> None:
    base, proxy = sidecar
    prefill = await start_worker("kv_producer")
    hung = await start_worker("kv_consumer", faults=FaultSettings(hang=True))  # accepts, never answers
    crashed = await start_worker("kv_consumer")
    crashed.crash("test: decode worker dies")
    alive = await start_worker("kv_consumer")
    status, headers, raw = await ask(base, [address(prefill)], [address(hung), address(crashed), address(alive)])
    split = split_of(headers)
    assert status == 200 and split["decode"] == address(alive) and content(raw)
    assert split["fallback"] == "-"  # the third decode worker re-fetched the KV the prefill worker still held
    assert counter(proxy, "poolgate_pd_retries_total", step="decode") == 2


async def test_expired_params_fall_back_to_a_plain_request(start_worker: Start,
                                                           sidecar: tuple[str, PdSidecar]) -> None:
    base, _ = sidecar
    prefill = await start_worker("kv_producer", kv_transfer=kv("kv_producer", abort_timeout_s=1e-6))
    decode = await start_worker("kv_consumer")
    status, headers, raw = await ask(base, [address(prefill)], [address(decode)])
    assert status == 200 and split_of(headers)["fallback"] == "params_refused" and content(raw)


async def test_no_decode_worker_answers_502(start_worker: Start, sidecar: tuple[str, PdSidecar]) -> None:
    base, proxy = sidecar
    prefill = await start_worker("kv_producer")
    status, _, raw = await ask(base, [address(prefill)], [f"127.0.0.1:{free_port()}"])
    assert status == 502 and orjson.loads(raw)["error"]["type"] == "server_error"
    status, _, raw = await ask(base, [address(prefill)], [])
    assert status == 502
    assert counter(proxy, "poolgate_pd_requests_total", outcome="failed") == 1


async def test_the_decode_workers_own_refusal_reaches_the_client_whole(start_worker: Start,
                                                                       sidecar: tuple[str, PdSidecar]) -> None:
    base, _ = sidecar
    prefill, decode = await start_worker("kv_producer"), await start_worker("kv_consumer")
    status, headers, raw = await ask(base, [address(prefill)], [address(decode)], max_tokens=100_000)
    error = orjson.loads(raw)["error"]  # the prefill (max_tokens 1) fits; the whole request does not
    assert status == 400 and "maximum context length" in error["message"]
    assert split_of(headers)["decode"] == address(decode)


async def test_a_client_leaving_mid_stream_is_not_retried_elsewhere(start_worker: Start,
                                                                   sidecar: tuple[str, PdSidecar]) -> None:
    base, proxy = sidecar
    prefill = await start_worker("kv_producer")
    first, second = await start_worker("kv_consumer", time_scale=1.0), await start_worker("kv_consumer")
    body = {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 2000,
            "stream": True}
    headers = {PREFILL_HEADER: address(prefill), DECODE_HEADER: f"{address(first)},{address(second)}"}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{base}/v1/chat/completions", json=body, headers=headers)
        assert response.status == 200 and await response.content.readany()
        response.close()  # the client goes away after its first tokens
    await asyncio.sleep(1.0)
    assert counter(proxy, "poolgate_pd_retries_total", step="decode") == 0
    assert second.engine.num_running + second.engine.num_waiting == 0
