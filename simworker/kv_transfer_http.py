"""The KV transfer of one simulated worker over HTTP: the producer's side channel and the consumer's read.

A producer (``kv_producer`` / ``kv_both``) serves ``POST /sim/kv_transfer/claim`` and
``POST /sim/kv_transfer/done`` on its own port (``remote_port`` of its params names it); a consumer reads
by claiming, waiting the modelled transfer time (``kv_transfer.transfer_seconds``) and saying done. The real
``NixlConnector`` does the same over its side channel (``VLLM_NIXL_SIDE_CHANNEL_PORT``) and NIXL.
Times are model seconds (``EngineDriver.model_now``), so ``--time-scale`` shortens the wait too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from simworker.kv_transfer import (
    HeldKV,
    KVTransferConfig,
    ProducerBlocks,
    RemotePrefill,
    transfer_seconds,
)
from simworker.protocol import WorkerApiError

log = logging.getLogger(__name__)

CLAIM_PATH = "/sim/kv_transfer/claim"
DONE_PATH = "/sim/kv_transfer/done"
CLAIM_TIMEOUT_S = 5.0
PARAMS_FIELD = "kv_transfer_params"
"""The error's ``param`` when a decode worker refuses params: a proxy falls back to a plain request on it."""


@dataclass(frozen=True)
class ReadKV:
    """What a consumer read: the tokens now in its cache, the bytes and the (model) seconds it took."""

    tokens: int
    bytes: int
    seconds: float


class KVTransferAgent:
    def __init__(self, config: KVTransferConfig, engine_id: str, host: str, port: int, block_size: int,
                 kv_bytes_per_token: int, time_scale: float, model_now: Callable[[], float]) -> None:
        self.config = config
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.kv_bytes_per_token = kv_bytes_per_token
        self.time_scale = time_scale
        self.model_now = model_now
        self.blocks = ProducerBlocks(block_size, config.abort_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def add_routes(self, app: web.Application) -> None:
        if self.config.produces:
            app.router.add_post(CLAIM_PATH, self._claim)
            app.router.add_post(DONE_PATH, self._done)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def produced(self, request_id: str, prompt_tokens: int) -> dict[str, object]:
        """A prefill for a remote decode finished: hold its blocks and answer the params that name them."""
        held = self.blocks.hold(request_id, prompt_tokens, self.model_now())
        return self.blocks.params(held, self.engine_id, self.host, self.port)

    async def read(self, remote: RemotePrefill) -> ReadKV:
        """Read a producer's blocks; WorkerApiError 400 (param ``kv_transfer_params``) when they expired or never
        existed, or the producer cannot be reached."""
        base = f"http://{remote.host}:{remote.port}"
        claim: dict[str, object] = {"engine_id": remote.engine_id, "request_id": remote.request_id,
                 "block_ids": list(remote.block_ids)}
        status, answer = await self._post(base + CLAIM_PATH, claim)
        if status != 200 or not isinstance(answer, dict) or not isinstance(answer.get("tokens"), int):
            reason = answer.get("reason") if isinstance(answer, dict) else None
            raise WorkerApiError(400, f"kv_transfer_params refused by the producer {remote.engine_id}: "
                                f"{reason or f'HTTP {status}'}", PARAMS_FIELD)
        tokens = answer["tokens"]
        seconds = transfer_seconds(tokens, self.kv_bytes_per_token, self.config.link_gb_per_s)
        await asyncio.sleep(seconds / self.time_scale)
        await self._post(base + DONE_PATH, {"engine_id": remote.engine_id, "request_id": remote.request_id})
        return ReadKV(tokens, tokens * self.kv_bytes_per_token, seconds)

    async def _post(self, url: str, body: dict[str, object]) -> tuple[int, object]:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CLAIM_TIMEOUT_S))
        try:
            async with self._session.post(url, data=orjson.dumps(body),
                                          headers={"Content-Type": "application/json"}) as response:
                raw = await response.read()
                return response.status, orjson.loads(raw) if raw else None
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as error:
            return 0, {"reason": f"producer unreachable ({type(error).__name__})"}

    async def _claim(self, request: web.Request) -> web.Response:
        body = await _body(request)
        if body.get("engine_id") != self.engine_id:
            return _answer({"reason": "unknown"}, 404)
        blocks = body.get("block_ids")
        outcome = self.blocks.claim(str(body.get("request_id")),
                                    tuple(blocks) if isinstance(blocks, list) else (), self.model_now())
        if not isinstance(outcome, HeldKV):
            return _answer({"reason": outcome}, 410 if outcome == "expired" else 404)
        return _answer({"tokens": outcome.tokens})

    async def _done(self, request: web.Request) -> web.Response:
        body = await _body(request)
        freed = body.get("engine_id") == self.engine_id and self.blocks.done(str(body.get("request_id")))
        return _answer({"freed": freed})


async def _body(request: web.Request) -> dict[str, object]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as error:
        raise WorkerApiError(400, f"the request body is not valid JSON: {error}") from error
    if not isinstance(body, dict):
        raise WorkerApiError(400, "the request body must be a JSON object")
    return body


def _answer(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")
