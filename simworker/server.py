"""HTTP surface of one simulated worker: vLLM's OpenAI server endpoints over aiohttp.

Handlers translate between HTTP and the driver; request rules live in ``protocol``. Every response,
errors and streams included, names the worker in the ``x-poolgate-worker`` header so a test or a
router can tell which backend answered.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from poolgate.kernel.routing import WORKER_HEADER
from simworker import protocol, tokens
from simworker.driver import EngineDriver, TokenStream
from simworker.engine import EngineRequest
from simworker.faults import FaultSettings
from simworker.kv_transfer import RemoteDecodeAsk, RemotePrefill, TransferParamsError, read_params
from simworker.kv_transfer_http import PARAMS_FIELD, KVTransferAgent
from simworker.lora import AdapterTable
from simworker.metrics import WorkerMetrics
from simworker.protocol import GenerationPlan, GenerationRequest, WorkerApiError

log = logging.getLogger(__name__)

SIM_VERSION = "0.10.2+poolgate.sim"
Health = Literal["starting", "ready", "dead"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class WorkerControl(Protocol):
    """What the HTTP layer needs from the worker that owns it."""

    @property
    def health(self) -> Health: ...

    @property
    def faults(self) -> FaultSettings: ...

    def set_faults(self, faults: FaultSettings) -> None: ...

    def note_inference_request(self) -> None: ...


@dataclass(frozen=True)
class ServingConfig:
    worker_id: str
    model_name: str
    model_root: str
    max_model_len: int
    block_size: int
    enable_prefix_caching: bool
    enable_fault_api: bool
    runtime_lora_updating: bool = False
    """Serve the adapter load/unload endpoints (vLLM: ``--enable-lora`` plus
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``)."""
    lora_load_s: float = 0.0
    """What loading one adapter costs, in seconds."""
    api_key: str | None = None
    """vLLM's ``--api-key`` (or ``VLLM_API_KEY``): requests to ``/v1`` paths must carry
    ``Authorization: Bearer <key>``."""


class WorkerApi:
    def __init__(self, config: ServingConfig, driver: EngineDriver, metrics: WorkerMetrics,
                 control: WorkerControl, rng: random.Random, adapters: AdapterTable | None = None,
                 kv_transfer: KVTransferAgent | None = None) -> None:
        self.config = config
        self.driver = driver
        self.metrics = metrics
        self.control = control
        self.rng = rng
        self.adapters = adapters
        """None without ``--enable-lora``: adapter names are unknown models."""
        self.kv_transfer = kv_transfer
        """None without ``--kv-transfer-config``: ``kv_transfer_params`` are ignored, as vLLM ignores them."""

    def build_app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth_middleware, self._hang_middleware, self._error_middleware])
        app.on_response_prepare.append(self._name_worker)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ping", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/version", self.version)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_post("/sim/cached_prefix", self.cached_prefix)
        if self.adapters is not None and self.config.runtime_lora_updating:
            app.router.add_post("/v1/load_lora_adapter", self.load_adapter)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_adapter)
        if self.kv_transfer is not None:
            self.kv_transfer.add_routes(app)
        if self.config.enable_fault_api:
            app.router.add_get("/sim/faults", self.get_faults)
            app.router.add_post("/sim/faults", self.set_faults)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.control.health == "ready" else 503)

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def version(self, request: web.Request) -> web.Response:
        return _json({"version": SIM_VERSION})

    async def models(self, request: web.Request) -> web.Response:
        listing = protocol.model_list(self.config.model_name, self.config.model_root, self.config.max_model_len)
        if self.adapters is not None:
            cards = listing["data"]
            assert isinstance(cards, list)
            base = cards[0]
            cards.extend({**base, "id": name, "root": path, "parent": self.config.model_name}
                         for name, path in self.adapters.loaded.items())
        return _json(listing)

    async def load_adapter(self, request: web.Request) -> web.Response:
        assert self.adapters is not None
        name, path = _adapter_fields(await _read_json(request), need_path=True)
        self.adapters.reserve(name, path)
        try:
            if self.config.lora_load_s:
                await asyncio.sleep(self.config.lora_load_s)
        except BaseException:
            self.adapters.loaded.pop(name, None)  # the client went away mid-load: the slot is free again
            raise
        log.info("worker %s loaded LoRA adapter %s from %s", self.config.worker_id, name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_adapter(self, request: web.Request) -> web.Response:
        assert self.adapters is not None
        name, _ = _adapter_fields(await _read_json(request), need_path=False)
        self.adapters.release(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's ``POST /reset_prefix_cache``: 200 with an empty body whether or not the engine refused.

        vLLM serves it only with ``VLLM_SERVER_DEV_MODE=1``; the simulator always does, because benchmarks
        reset the workers' caches between runs and a simulated cache holds nothing to protect. Like vLLM
        it takes ``reset_running_requests`` (preempt running requests so the reset cannot be refused) and
        ``reset_external`` (accepted; there is no external cache here), and it needs no API key (not a
        ``/v1`` path).
        """
        preempt_running = _query_bool(request, "reset_running_requests")
        _query_bool(request, "reset_external")
        done = self.driver.reset_prefix_cache(preempt_running)
        if done:
            log.info("worker %s reset its prefix cache", self.config.worker_id)
        else:
            log.warning("worker %s: prefix cache not reset, some blocks are still held", self.config.worker_id)
        return web.Response(status=200)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_completion)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.parse_chat)

    async def cached_prefix(self, request: web.Request) -> web.Response:
        """Simulator-only ground truth (vLLM has no such endpoint): how many leading tokens of this request's
        prompt the engine's prefix cache holds right now, counted exactly as the engine counts a hit when it
        schedules the request, with the engine's queue lengths. Takes a chat body (``messages``) or a
        completions body (``prompt``); reads only, so it needs neither the fault API nor a key. Benchmarks
        use it for an oracle router that always knows which worker holds the longest prefix."""
        body = await _read_json(request)
        parse = protocol.parse_chat if isinstance(body, dict) and "messages" in body else protocol.parse_completion
        generation = parse(body)
        prompt = len(generation.prompt_tokens)
        cached = 0
        if self.config.enable_prefix_caching:
            block_size = self.config.block_size
            hashes = tokens.block_hashes(generation.prompt_tokens, block_size)
            cached = self.driver.engine.kv.cached_prefix_blocks(hashes[:(prompt - 1) // block_size]) * block_size
        engine = self.driver.engine
        return _json({"cached_tokens": cached, "prompt_tokens": prompt, "running": engine.num_running,
                      "waiting": engine.num_waiting})

    async def get_faults(self, request: web.Request) -> web.Response:
        return _json(self.control.faults.as_dict())

    async def set_faults(self, request: web.Request) -> web.Response:
        body = await _read_json(request)
        if not isinstance(body, dict):
            raise WorkerApiError(400, "the body must be a JSON object of fault settings")
        try:
            faults = self.control.faults.updated(body)
        except ValueError as error:
            raise WorkerApiError(400, str(error)) from error
        self.control.set_faults(faults)
        return _json(faults.as_dict())

    async def _generate(self, request: web.Request,
                        parse: Callable[[object], GenerationRequest]) -> web.StreamResponse:
        self._require_serving()
        body = await _read_json(request)
        generation = parse(body)
        transfer = self._transfer_step(body)
        served = self.config.model_name
        adapter: str | None = None
        if generation.model is not None and generation.model != served:
            if self.adapters is None or generation.model not in self.adapters.loaded:
                raise WorkerApiError(404, f"The model `{generation.model}` does not exist.", "model")
            adapter = served = generation.model
        plan = protocol.plan_generation(generation, self.config.max_model_len, served)
        self.control.note_inference_request()
        self._require_serving()
        faults = self.control.faults
        if faults.error_rate and self.rng.random() < faults.error_rate:
            raise WorkerApiError(500, "simulated internal server error (fault injection)")
        if faults.added_latency_s:
            await asyncio.sleep(faults.added_latency_s)
        request_id = protocol.new_request_id(generation.kind)
        remote_tokens = 0
        if isinstance(transfer, RemotePrefill) and self.kv_transfer is not None:
            read = await self.kv_transfer.read(transfer)
            remote_tokens = min(read.tokens, plan.prompt_tokens - 1)  # the last prompt token is run here
        hashes = (tokens.block_hashes(generation.prompt_tokens, self.config.block_size)
                  if self.config.enable_prefix_caching else ())
        stream = self.driver.submit(EngineRequest(
            request_id=request_id, prompt_tokens=plan.prompt_tokens, output_target=plan.output_target,
            finish_reason_at_target=plan.finish_reason, prompt_block_hashes=hashes,
            prompt_token_ids=tuple(tokens.token_ids(generation.prompt_tokens)) if hashes else (),
            remote_computed_tokens=remote_tokens,
        ))
        if adapter is not None and self.adapters is not None:
            self.adapters.begin(request_id, adapter)
        try:
            if generation.stream:
                return await self._stream(request, generation, plan, request_id, stream, served)
            return await self._respond_when_done(generation, plan, request_id, stream, served,
                                                 produce=isinstance(transfer, RemoteDecodeAsk))
        finally:
            self.driver.abort(request_id)  # no-op once finished; frees KV if the client went away
            if adapter is not None and self.adapters is not None:
                self.adapters.end(request_id)

    def _note_progress(self, request_id: str, stream: TokenStream) -> None:
        """An adapter request counts as waiting until its first token, then as running."""
        if self.adapters is not None and (stream.tokens or stream.finished is not None):
            self.adapters.started(request_id)

    def _transfer_step(self, body: object) -> RemoteDecodeAsk | RemotePrefill | None:
        """Which step of the KV-transfer protocol a request is, for this worker's ``kv_role``."""
        if self.kv_transfer is None:
            return None
        try:
            step = read_params(body)
        except TransferParamsError as error:
            raise WorkerApiError(400, str(error), PARAMS_FIELD) from error
        role = self.kv_transfer.config
        if isinstance(step, RemoteDecodeAsk):
            return step if role.produces else None
        if isinstance(step, RemotePrefill):
            return step if role.consumes else None
        return None

    async def _respond_when_done(self, generation: GenerationRequest, plan: GenerationPlan, request_id: str,
                                 stream: TokenStream, model: str, produce: bool = False) -> web.Response:
        while stream.finished is None:
            await stream.wait_change()
            self._note_progress(request_id, stream)
        finished = stream.finished
        if finished.reason == "error":
            raise WorkerApiError(500, "the engine failed while serving this request")
        text = protocol.generated_text(plan.text_seed, 0, finished.output_tokens)
        answer = protocol.full_response(
            generation.kind, request_id, model, int(time.time()), text, finished.reason,
            plan.prompt_tokens, finished.output_tokens,
        )
        if produce and self.kv_transfer is not None:
            answer[PARAMS_FIELD] = self.kv_transfer.produced(request_id, plan.prompt_tokens)
        return _json(answer)

    async def _stream(self, request: web.Request, generation: GenerationRequest, plan: GenerationPlan,
                      request_id: str, stream: TokenStream, model: str) -> web.StreamResponse:
        """SSE as vLLM sends it: headers at once, then events as tokens come. A chat stream's role chunk
        (``delta.role``, empty content) goes out with the first token, as vLLM's ``serving_chat`` sends it
        on the engine's first output, so a client timing the first event measures the time to first token."""
        kind, created = generation.kind, int(time.time())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        sent = 0
        try:
            while True:
                await stream.wait_change()
                self._note_progress(request_id, stream)
                finished = stream.finished
                if finished is not None and finished.reason == "error":
                    await response.write(_event(WorkerApiError(500, "the engine failed while serving this request")
                                                .body()) + b"data: [DONE]\n\n")
                    break
                available = stream.tokens if finished is None else finished.output_tokens
                chunks = []
                if kind == "chat" and sent == 0 and available:  # vLLM's role chunk comes with the first output
                    chunks.append(_event(protocol.stream_chunk(kind, request_id, model, created, "", None,
                                                               first=True)))
                for index in range(sent, available):
                    reason = finished.reason if finished is not None and index == available - 1 else None
                    chunks.append(_event(protocol.stream_chunk(
                        kind, request_id, model, created, tokens.filler_token(plan.text_seed, index), reason)))
                sent = available
                if finished is not None:
                    if generation.include_usage:
                        chunks.append(_event(protocol.usage_chunk(kind, request_id, model, created,
                                                                  plan.prompt_tokens, finished.output_tokens)))
                    chunks.append(b"data: [DONE]\n\n")
                if chunks:
                    await response.write(b"".join(chunks))
                if finished is not None:
                    break
            await response.write_eof()
        except ConnectionResetError:
            log.debug("client of %s went away mid-stream", request_id)
        return response

    def _require_serving(self) -> None:
        health = self.control.health
        if health == "dead":
            raise WorkerApiError(500, "The engine is dead (simulated crash); restart the worker.")
        if health == "starting":
            raise WorkerApiError(503, "The server is still starting.")

    @web.middleware
    async def _error_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except WorkerApiError as error:
            return _json(error.body(), status=error.status)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return _json(WorkerApiError(error.status, error.reason).body(), status=error.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("unexpected error serving %s %s", request.method, request.path)
            return _json(WorkerApiError(500, "internal error in the simulated worker").body(), status=500)

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """vLLM's check, in its place (before anything else) and with its answer: only ``/v1`` paths need the
        key; health, metrics and version stay open for probes and scrapers."""
        key = self.config.api_key
        if key and request.path.startswith("/v1") and request.method != "OPTIONS":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return _json({"error": "Unauthorized"}, status=401)
        return await handler(request)

    @web.middleware
    async def _hang_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.control.faults.hang and not request.path.startswith("/sim/"):
            await asyncio.get_running_loop().create_future()  # never answers; a disconnect cancels it
        return await handler(request)

    async def _name_worker(self, request: web.Request, response: web.StreamResponse) -> None:
        response.headers[WORKER_HEADER] = self.config.worker_id


async def _read_json(request: web.Request) -> object:
    raw = await request.read()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise WorkerApiError(400, f"the request body is not valid JSON: {error}") from error


_TRUE = frozenset({"1", "true", "t", "yes", "y", "on"})
_FALSE = frozenset({"0", "false", "f", "no", "n", "off"})


def _query_bool(request: web.Request, name: str) -> bool:
    """A boolean query parameter, read as FastAPI reads one for vLLM; anything else is a 400."""
    raw = request.query.get(name)
    if raw is None or raw.lower() in _FALSE:
        return False
    if raw.lower() in _TRUE:
        return True
    raise WorkerApiError(400, f"query parameter '{name}' must be a boolean, got {raw!r}", name)


def _adapter_fields(body: object, need_path: bool) -> tuple[str, str]:
    if not isinstance(body, dict):
        raise WorkerApiError(400, "the request body must be a JSON object")
    name, path = body.get("lora_name"), body.get("lora_path")
    if not isinstance(name, str) or not name:
        raise WorkerApiError(400, "'lora_name' must be a non-empty string", "lora_name")
    if need_path and (not isinstance(path, str) or not path):
        raise WorkerApiError(400, "'lora_path' must be a non-empty string", "lora_path")
    return name, path if isinstance(path, str) else ""


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _event(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"
