"""The prefill/decode sidecar: runs a split request's two steps, since Envoy sends one request upstream.

Envoy routes a request here when extproc named the sidecar's cluster; extproc also set the pair in
``x-poolgate-prefill`` / ``x-poolgate-decode`` (``ip:port`` lists, best first; Envoy strips a client's copies
before extproc runs, so only extproc's values arrive). The protocol is vLLM's (``simworker.kv_transfer``
describes it), driven as vLLM's disaggregated proxy and llm-d's routing sidecar drive it:

1. **Prefill**: the request with ``max_tokens: 1``, ``stream: false``, no ``stream_options`` and
   ``kv_transfer_params: {"do_remote_decode": true, …}`` goes to the prefill worker; its answer's
   ``kv_transfer_params`` name the KV it holds. A prefill worker that fails (connection refused or reset, a
   5xx, no answer within ``step_timeout_s``) is replaced by the next one; nothing reached the client yet.
   With no prefill answer at all the request goes to the decode worker as an ordinary request.
2. **Decode**: the client's request, unchanged but for those params, goes to the decode worker, which
   reads the KV and generates. Its status, headers and bytes are relayed as they come; the client's response
   starts only with the decode worker's first body bytes, so a decode worker that fails before them (no
   connection, a 5xx, a stream whose first event is an error, silence past ``step_timeout_s``) is replaced
   by the next one with the same params: the new one re-fetches the KV from the prefill worker, which holds
   it until a reader finished. If the params are refused (expired, already read to the end by a worker that
   died after reading, producer gone: 400 with ``param: kv_transfer_params``), the same decode worker gets the
   ordinary request and recomputes the prompt.

Per token there is no work here but relaying bytes (``iter_any`` chunks as they arrive). The response names
the split in ``x-poolgate-pd`` (for Envoy's access log); the metrics (``/metrics``) give each step's time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from poolgate.kernel.routing import DECODE_HEADER, PREFILL_HEADER, WORKER_HEADER

log = logging.getLogger(__name__)

PD_HEADER = "x-poolgate-pd"
"""Response header: ``prefill=ip:port decode=ip:port prefill_ms=… kv_tokens=… fallback=…`` (``-`` when none)."""
PARAMS_FIELD = "kv_transfer_params"
FORWARDED = ("authorization", "x-request-id", "traceparent", "tracestate", "x-poolgate-tenant", "x-poolgate-decision")
"""Request headers the workers get; the pair headers and hop-by-hop ones stay here."""
RELAYED = ("content-type", "cache-control", WORKER_HEADER)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05)


class SidecarMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.requests = Counter("poolgate_pd_requests", "Split requests by how they ended: split (prefill then "
                                "decode), plain (decoded without remote KV: no prefill answer or params refused), "
                                "refused (the decode worker's own 4xx), failed (no decode worker answered)",
                                ["outcome"], registry=self.registry)
        self.retries = Counter("poolgate_pd_retries", "A step tried again on the next worker, by step",
                               ["step"], registry=self.registry)
        self.step_seconds = Histogram("poolgate_pd_step_seconds", "Time of each step: prefill (the prefill "
                                      "worker's answer: its time to first token) and decode_first_byte (the decode "
                                      "worker's first bytes: KV transfer plus its first token)", ["step"],
                                      buckets=STEP_BUCKETS, registry=self.registry)
        self.overhead_seconds = Histogram("poolgate_pd_overhead_seconds", "The sidecar's own time before a "
                                          "request's first byte, waits on workers excluded",
                                          buckets=OVERHEAD_BUCKETS, registry=self.registry)
        self.kv_tokens = Counter("poolgate_pd_kv_tokens", "Prompt tokens whose KV decode workers were told to read "
                                 "(bytes: times the model's KV bytes per token)", registry=self.registry)


@dataclass(frozen=True)
class Prefilled:
    endpoint: str
    params: dict[str, object]
    prompt_tokens: int
    seconds: float


StepFailure = Literal["retry", "refused"]


class PdSidecar:
    def __init__(self, step_timeout_s: float, metrics: SidecarMetrics | None = None) -> None:
        self.step_timeout_s = step_timeout_s
        self.metrics = metrics or SidecarMetrics()
        self._session: aiohttp.ClientSession | None = None

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=0)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics_page)
        app.router.add_post("/{path:.*}", self.handle)
        app.on_cleanup.append(self._close)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        decodes = _endpoints(request.headers.get(DECODE_HEADER))
        if not decodes:
            return _error(502, "the sidecar got a request without a decode worker (route it through extproc)")
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as error:
            return _error(400, f"the request body is not valid JSON: {error}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = {name: request.headers[name] for name in FORWARDED if name in request.headers}
        headers["content-type"] = "application/json"
        url_path = request.rel_url.path_qs
        waited = 0.0
        prefilled = None
        for index, endpoint in enumerate(_endpoints(request.headers.get(PREFILL_HEADER))):
            if index:
                self.metrics.retries.labels("prefill").inc()
            outcome = await self._prefill(endpoint, url_path, body, headers)
            if isinstance(outcome, web.Response):
                return outcome  # the request itself is wrong: the worker's 4xx is the answer
            if isinstance(outcome, Prefilled):
                prefilled = outcome
                waited += outcome.seconds
                self.metrics.step_seconds.labels("prefill").observe(outcome.seconds)
                break
        plain = orjson.dumps(body)
        fallback = "-" if prefilled is not None else "no_prefill"
        payload = plain if prefilled is None else orjson.dumps({**body, PARAMS_FIELD: prefilled.params})
        streaming = body.get("stream") is True
        for index, endpoint in enumerate(decodes):
            if index:
                self.metrics.retries.labels("decode").inc()
            sent_at = time.perf_counter()
            answer = await self._decode(request, endpoint, url_path, payload, headers, streaming,
                                        sent_at - arrived - waited, prefilled, fallback)
            if answer == "refused":  # the KV cannot be read: the same worker computes the prompt itself
                fallback, payload, prefilled = "params_refused", plain, None
                waited += time.perf_counter() - sent_at
                sent_at = time.perf_counter()
                answer = await self._decode(request, endpoint, url_path, payload, headers, streaming,
                                            sent_at - arrived - waited, None, fallback)
            if isinstance(answer, web.StreamResponse):
                return answer
            waited += time.perf_counter() - sent_at
        self.metrics.requests.labels("failed").inc()
        return _error(502, f"no decode worker answered ({len(decodes)} tried)")

    async def _prefill(self, endpoint: str, path: str, body: Mapping[str, object],
                       headers: Mapping[str, str]) -> Prefilled | web.Response | None:
        """One prefill try: the params, the worker's own 4xx (the request is wrong), or None (try the next)."""
        ask = {key: value for key, value in body.items() if key != "stream_options"}
        ask.update(stream=False, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        if "max_completion_tokens" in ask:
            ask["max_completion_tokens"] = 1
        started = time.perf_counter()
        try:
            async with self._client().post(f"http://{endpoint}{path}", data=orjson.dumps(ask), headers=headers,
                                           timeout=self._timeout()) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            log.warning("prefill worker %s failed (%s); trying the next", endpoint, type(error).__name__)
            return None
        if 400 <= status < 500:
            return web.Response(body=raw, status=status, content_type="application/json")
        answer = _json_object(raw) if status == 200 else None
        params = answer.get(PARAMS_FIELD) if answer is not None else None
        if not isinstance(params, dict):
            log.warning("prefill worker %s answered %d without kv_transfer_params; trying the next", endpoint, status)
            return None
        usage = answer.get("usage") if answer is not None else None
        tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        return Prefilled(endpoint, params, tokens if isinstance(tokens, int) else 0, time.perf_counter() - started)

    async def _decode(self, request: web.Request, endpoint: str, path: str, payload: bytes,
                      headers: Mapping[str, str], streaming: bool, overhead_s: float,
                      prefilled: Prefilled | None, fallback: str) -> web.StreamResponse | StepFailure:
        """One decode try, relayed to the client once its first bytes came; else what to do next.
        ``overhead_s`` is the sidecar's own time so far (parsing, encoding, bookkeeping)."""
        sent_at = time.perf_counter()
        response: web.StreamResponse | None = None
        try:
            async with self._client().post(f"http://{endpoint}{path}", data=payload, headers=headers,
                                           timeout=self._timeout()) as upstream:
                if upstream.status >= 500:
                    log.warning("decode worker %s answered %d; trying the next", endpoint, upstream.status)
                    return "retry"
                if upstream.status != 200:  # the worker's refusal: read whole, it is the answer unless the KV is
                    raw = await upstream.read()
                    if prefilled is not None and upstream.status == 400 and _refused_params(raw):
                        log.info("decode worker %s refused the KV params; sending it the plain request", endpoint)
                        return "refused"
                    self.metrics.requests.labels("refused").inc()
                    return web.Response(body=raw, status=upstream.status,
                                        headers=self._relayed(upstream.headers, endpoint, prefilled, fallback))
                first = await upstream.content.readany()
                if not first or (streaming and first.startswith(b'data: {"error"')):
                    log.warning("decode worker %s failed before its first token; trying the next", endpoint)
                    return "retry"
                first_byte = time.perf_counter()
                self.metrics.step_seconds.labels("decode_first_byte").observe(first_byte - sent_at)
                self.metrics.overhead_seconds.observe(max(0.0, overhead_s))
                if prefilled is not None:
                    self.metrics.kv_tokens.inc(prefilled.prompt_tokens)
                self.metrics.requests.labels("split" if prefilled is not None else "plain").inc()
                response = web.StreamResponse(status=upstream.status, headers=self._relayed(
                    upstream.headers, endpoint, prefilled, fallback))
                await response.prepare(request)
                await response.write(first)
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, TimeoutError, ConnectionResetError) as error:
            if response is not None and response.prepared:  # bytes reached the client: never replayed
                log.info("stream from decode worker %s ended early (%s)", endpoint, type(error).__name__)
                return response
            log.warning("decode worker %s failed (%s) before its first token; trying the next", endpoint,
                        type(error).__name__)
            return "retry"

    def _relayed(self, upstream: Mapping[str, str], endpoint: str, prefilled: Prefilled | None,
                 fallback: str) -> CIMultiDict[str]:
        headers: CIMultiDict[str] = CIMultiDict((name, upstream[name]) for name in RELAYED if name in upstream)
        split = (f"prefill={prefilled.endpoint} decode={endpoint} prefill_ms={prefilled.seconds * 1000:.1f} "
                 f"kv_tokens={prefilled.prompt_tokens}" if prefilled is not None
                 else f"prefill=- decode={endpoint} prefill_ms=- kv_tokens=0")
        headers[PD_HEADER] = f"{split} fallback={fallback}"
        return headers

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30),
                                                  auto_decompress=False)
        return self._session

    def _timeout(self) -> aiohttp.ClientTimeout:
        """Until the answer's first bytes (connect plus headers, then each read); a stream may last any time."""
        return aiohttp.ClientTimeout(total=None, sock_connect=self.step_timeout_s, sock_read=self.step_timeout_s)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()


def _endpoints(value: str | None) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()] if value else []


def _json_object(raw: bytes) -> dict[str, object] | None:
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _refused_params(raw: bytes) -> bool:
    answer = _json_object(raw)
    error = answer.get("error") if answer is not None else None
    return isinstance(error, dict) and error.get("param") == PARAMS_FIELD


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.Response(body=orjson.dumps({"error": {"message": message, "type": kind, "param": None,
                                                     "code": status}}),
                        status=status, content_type="application/json")


async def serve(host: str, port: int, step_timeout_s: float, stop: asyncio.Event) -> None:
    """Listen until ``stop``; open streams get a second to finish."""
    sidecar = PdSidecar(step_timeout_s)
    runner = web.AppRunner(sidecar.build_app(), access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
        log.info("prefill/decode sidecar listening on %s:%d", host, port)
        await stop.wait()
    finally:
        await runner.cleanup()
