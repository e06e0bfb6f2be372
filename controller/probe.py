"""Active probe of one worker over HTTP: ``/health`` (engine alive) and ``/v1/models`` (serves its model).

vLLM answers ``/health`` 200 while its engine core lives and 503 once it died; a refused connection means
the process is gone or still loading; no answer within the timeout means it hangs. What a worker serves
changes only when it restarts (a new registration), so ``/v1/models`` is asked on its first probe, then at
most every ``MODELS_RECHECK_S`` and after every failed check: probing a fleet costs about one request per
worker, not two.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable

import orjson

from controller.health import ProbeResult
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.lean_http import LeanHttpClient

MODELS_RECHECK_S = 60.0
"""A worker whose ``/v1/models`` listed its model is asked again after this long (or once re-registered)."""
MAX_REMEMBERED = 25_000
"""Workers whose last good ``/v1/models`` is remembered at most (then the memory starts again)."""
MAX_MODELS_BYTES = 1024 * 1024
"""A ``/v1/models`` answer may be this large at most (a worker with many adapters lists each)."""


class HttpProber:
    """Probes ``/health`` and ``/v1/models`` over the worker's kept-alive connection (``LeanHttpClient``),
    with the workers' ``api_key`` when they have one; each probe is bounded by ``timeout_s`` in total."""

    def __init__(self, timeout_s: float, check_models: bool, clock: Callable[[], float] = time.perf_counter,
                 scheme: str = "http", models_recheck_s: float = MODELS_RECHECK_S,
                 tls: ssl.SSLContext | None = None, api_key: str | None = None) -> None:
        # a worker started with --api-key guards /v1 (its model listing); /health stays open either way
        self._http = LeanHttpClient(tls, b"Authorization: Bearer %s\r\n" % api_key.encode() if api_key else b"")
        self._https = scheme == "https"
        self._timeout = timeout_s
        self._check_models = check_models
        self._clock = clock
        self._models_recheck_s = models_recheck_s
        self._models_seen: dict[str, tuple[float, float]] = {}
        """Worker id → (its ``registered_at``, when its ``/v1/models`` last listed its model)."""
        self._probed: dict[tuple[str, int], str] = {}
        """Address → the worker last probed there (``hung_up`` names workers)."""
        self.models_checks = 0

    def close(self) -> None:
        self._http.close()

    def hung_up(self) -> list[str]:
        """Workers whose kept-alive probe connection they closed since the last call: a process that exited
        (or a keep-alive timeout: worth a probe, not a verdict)."""
        return [worker_id for host, port, _ in self._http.closed_idle()
                if (worker_id := self._probed.get((host, port))) is not None]

    async def probe(self, record: WorkerRecord) -> ProbeResult:
        if len(self._probed) >= MAX_REMEMBERED:
            self._probed.clear()
        self._probed[(record.host, record.port)] = record.id
        started = self._clock()
        try:
            reason = await self._probe(record, asyncio.get_running_loop().time() + self._timeout)
        except TimeoutError:
            reason = f"no answer within {self._timeout:g} s"
        except ConnectionRefusedError:
            reason = "connection refused"
        except (OSError, ValueError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        return ProbeResult(ok=not reason, latency_s=self._clock() - started, reason=reason)

    async def _probe(self, record: WorkerRecord, deadline: float) -> str:
        address = (record.host, record.port, self._https)
        status, _ = await self._http.request(b"GET", address, b"/health", deadline=deadline)
        if status != 200:
            return f"/health answered {status}"
        if not self._check_models:
            return ""
        now = self._clock()
        seen = self._models_seen.get(record.id)
        if seen is not None and seen[0] == record.registered_at and now - seen[1] < self._models_recheck_s:
            return ""
        self._models_seen.pop(record.id, None)
        self.models_checks += 1
        status, body = await self._http.request(b"GET", address, b"/v1/models", max_body=MAX_MODELS_BYTES,
                                                deadline=deadline)
        if status != 200:
            return f"/v1/models answered {status}"
        served = {card.get("id") for card in orjson.loads(body).get("data", []) if isinstance(card, dict)}
        if not served & set(record.names):
            return f"/v1/models does not list {record.names[0]!r}"
        if len(self._models_seen) >= MAX_REMEMBERED:
            self._models_seen.clear()  # workers long gone; everyone is simply asked once more
        self._models_seen[record.id] = (record.registered_at, now)
        return ""
