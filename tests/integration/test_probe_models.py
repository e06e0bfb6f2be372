"""The active probe over real HTTP: ``/v1/models`` is asked once per registration and then only every
``models_recheck_s``, while ``/health`` is asked every probe; a wrong model fails and is asked again."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
from aiohttp import web

from controller.probe import HttpProber
from poolgate.kernel.fleet import WorkerRecord


@pytest.fixture()
async def worker() -> AsyncIterator[tuple[WorkerRecord, Counter[str], list[str]]]:
    hits: Counter[str] = Counter()
    served = ["m1"]

    async def health(request: web.Request) -> web.Response:
        hits["health"] += 1
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        hits["models"] += 1
        if request.headers.get("Authorization", "Bearer worker-key") != "Bearer worker-key":
            return web.json_response({"error": "bad key"}, status=401)  # as vLLM started with --api-key
        return web.json_response({"object": "list", "data": [{"id": name} for name in served]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    yield WorkerRecord(id="w1", pool="p", model="m1", host="127.0.0.1", port=port, registered_at=1.0), hits, served
    await runner.cleanup()


async def test_models_are_asked_once_per_registration_and_period(
        worker: tuple[WorkerRecord, Counter[str], list[str]]) -> None:
    record, hits, served = worker
    now = [0.0]
    prober = HttpProber(2.0, True, clock=lambda: now[0], models_recheck_s=10.0)
    for _ in range(5):
        assert (await prober.probe(record)).ok
        now[0] += 1.0
    assert hits == {"health": 5, "models": 1}
    assert (await prober.probe(replace(record, registered_at=2.0))).ok  # restarted: asked again
    assert hits["models"] == 2
    now[0] += 10.0
    served[:] = ["other"]
    result = await prober.probe(replace(record, registered_at=2.0))  # the period is over: asked again
    assert not result.ok and "does not list 'm1'" in result.reason
    result = await prober.probe(replace(record, registered_at=2.0))
    assert not result.ok and hits["models"] == 4  # a failed check is repeated on every probe
    prober.close()


async def test_the_models_check_carries_the_workers_api_key(
        worker: tuple[WorkerRecord, Counter[str], list[str]]) -> None:
    record, _, _ = worker
    prober = HttpProber(2.0, True, api_key="worker-key")
    assert (await prober.probe(record)).ok
    prober.close()
    prober = HttpProber(2.0, True, api_key="wrong-key")
    result = await prober.probe(record)
    assert not result.ok and result.reason == "/v1/models answered 401"
    prober.close()
