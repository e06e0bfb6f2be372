"""vLLM's sleep mode, simulated: a worker that gives its GPU back without stopping, and wakes in seconds.

vLLM started with ``--enable-sleep-mode`` (CUDA builds; ROCm in recent releases; the HTTP endpoints only with
``VLLM_SERVER_DEV_MODE=1``) serves ``POST /sleep?level=N`` — level 1 offloads the weights to CPU memory and
drops the KV cache, level 2 drops both — ``POST /wake_up`` and ``GET /is_sleeping``, and exports
``vllm:engine_sleep_state{engine, sleep_state}`` (``awake``, ``weights_offloaded``, ``discard_all``: 1 for the
current state). A sleeping engine still answers ``/health``; it serves no request until it wakes.

Here waking takes ``wake_up_s`` (the weights' copy back to the GPU; vLLM's own figures are tenths of a second
for small models up to seconds for large ones) against the ``--startup-delay-s`` of a cold start. A request
that reaches a sleeping worker gets a 503 (a router must not send one: poolgate's does not).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger(__name__)

STATES = {0: "awake", 1: "weights_offloaded", 2: "discard_all"}


class SleepMode:
    def __init__(self, worker_id: str, wake_up_s: float, registry: CollectorRegistry) -> None:
        self.worker_id = worker_id
        self.wake_up_s = wake_up_s
        self.level = 0
        self._state = Gauge("vllm:engine_sleep_state", "Engine sleep state: 1 for the current one.",
                            ("engine", "sleep_state"), registry=registry)
        self._show()

    def install(self, app: web.Application) -> None:
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        app.middlewares.append(self._refuse_while_asleep)

    def _show(self) -> None:
        for level, state in STATES.items():
            self._state.labels(engine="0", sleep_state=state).set(1 if level == self.level else 0)

    async def sleep(self, request: web.Request) -> web.Response:
        try:
            level = int(request.query.get("level", "1"))
        except ValueError:
            level = -1
        if level not in (1, 2):
            return web.json_response({"error": "level must be 1 or 2"}, status=400)
        self.level = level
        self._show()
        log.info("worker %s sleeps at level %d", self.worker_id, level)
        return web.Response(status=200)

    async def wake_up(self, request: web.Request) -> web.Response:
        if self.level:
            await asyncio.sleep(self.wake_up_s)
            log.info("worker %s woke after %.2f s", self.worker_id, self.wake_up_s)
        self.level = 0
        self._show()
        return web.Response(status=200)

    async def is_sleeping(self, request: web.Request) -> web.Response:
        return web.json_response({"is_sleeping": bool(self.level)})

    @web.middleware
    async def _refuse_while_asleep(self, request: web.Request,
                                   handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                   ) -> web.StreamResponse:
        if self.level and request.method == "POST" and request.path.startswith("/v1/"):
            return web.json_response({"error": {"message": "the engine is sleeping", "type": "ServiceUnavailable",
                                                "code": 503}}, status=503)
        return await handler(request)
