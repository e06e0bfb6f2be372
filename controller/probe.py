"""Active probe of one worker over HTTP: ``/health`` (engine alive) and ``/v1/models`` (serves its model).

vLLM answers ``/health`` 200 while its engine core lives and 503 once it died; a refused connection means
the process is gone or still loading; no answer within the timeout means it hangs. What a worker serves
changes only when it restarts (a new registration), so ``/v1/models`` is asked on its first probe, then at
most every ``MODELS_RECHECK_S`` and after every failed check: probing a fleet costs about one request per
worker, not two. That one request on a kept-alive connection runs with no coroutine (``ask``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import Awaitable, Callable

import orjson

from controller.health import ProbeResult
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.lean_http import LeanHttpClient, PeerClosed

log = logging.getLogger("poolgate.controller.health")

Answered = Callable[[ProbeResult | None], None]
"""Told a probe's result once; None where there is none (the probe raised, which is logged, or was cancelled)."""

MODELS_RECHECK_S = 60.0
"""A worker whose ``/v1/models`` listed its model is asked again after this long (or once re-registered)."""
MAX_REMEMBERED = 25_000
"""Workers whose last good ``/v1/models`` is remembered at most (then the memory starts again)."""
MAX_MODELS_BYTES = 1024 * 1024
"""A ``/v1/models`` answer may be this large at most (a worker with many adapters lists each)."""


class ProbesInTasks:
    """Probes run as tasks of ``probe``, each result handed to a callback: ``ask`` for a prober that has only a
    coroutine, and for ``HttpProber``'s probes that open a connection or list models."""

    def __init__(self, probe: Callable[[WorkerRecord], Awaitable[ProbeResult]]) -> None:
        self._probe = probe
        self._tasks: set[asyncio.Future[ProbeResult]] = set()
        """Kept here: the loop holds tasks weakly."""

    def ask(self, record: WorkerRecord, answered: Answered) -> None:
        task = asyncio.ensure_future(self._probe(record))
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._done, answered))

    def _done(self, answered: Answered, task: asyncio.Future[ProbeResult]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            answered(None)
        elif (error := task.exception()) is not None:
            log.warning("probe failed: %r", error)
            answered(None)
        else:
            answered(task.result())


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
        self._in_tasks = ProbesInTasks(self.probe)
        self.models_checks = 0

    def close(self) -> None:
        self._http.close()

    def hung_up(self) -> list[str]:
        """Workers whose kept-alive probe connection they closed since the last call: a process that exited
        (or a keep-alive timeout: worth a probe, not a verdict)."""
        return [worker_id for host, port, _ in self._http.closed_idle()
                if (worker_id := self._probed.get((host, port))) is not None]

    async def probe(self, record: WorkerRecord) -> ProbeResult:
        self._remember(record)
        started = self._clock()
        try:
            reason = await self._probe(record, asyncio.get_running_loop().time() + self._timeout)
        except (OSError, ValueError) as exc:
            reason = self._reason(exc)
        return ProbeResult(ok=not reason, latency_s=self._clock() - started, reason=reason)

    def ask(self, record: WorkerRecord, answered: Answered) -> None:
        """``probe``, its result handed to ``answered``; with no coroutine where it is one ``/health`` request on
        a kept-alive connection (every probe of a steady fleet but the rare ``/v1/models``), with a task running
        ``probe`` where it is not."""
        self._remember(record)
        started = self._clock()
        if self._models_due(record, started) or not self._http.ask_kept(
                b"GET", (record.host, record.port, self._https), b"/health",
                asyncio.get_running_loop().time() + self._timeout,
                functools.partial(self._health_answered, record, started, answered)):
            self._in_tasks.ask(record, answered)

    def _health_answered(self, record: WorkerRecord, started: float, answered: Answered,
                         outcome: tuple[int, bytes] | BaseException) -> None:
        if isinstance(outcome, PeerClosed):  # closed as it was asked: ask again, on a new connection
            self._in_tasks.ask(record, answered)
            return
        if isinstance(outcome, BaseException):
            reason = self._reason(outcome)
        else:
            reason = "" if outcome[0] == 200 else f"/health answered {outcome[0]}"
        answered(ProbeResult(ok=not reason, latency_s=self._clock() - started, reason=reason))

    def _remember(self, record: WorkerRecord) -> None:
        if len(self._probed) >= MAX_REMEMBERED:
            self._probed.clear()
        self._probed[(record.host, record.port)] = record.id

    def _reason(self, error: BaseException) -> str:
        if isinstance(error, TimeoutError):
            return f"no answer within {self._timeout:g} s"
        if isinstance(error, ConnectionRefusedError):
            return "connection refused"
        return f"{type(error).__name__}: {error}"

    def _models_due(self, record: WorkerRecord, now: float) -> bool:
        if not self._check_models:
            return False
        seen = self._models_seen.get(record.id)
        return seen is None or seen[0] != record.registered_at or now - seen[1] >= self._models_recheck_s

    async def _probe(self, record: WorkerRecord, deadline: float) -> str:
        address = (record.host, record.port, self._https)
        status, _ = await self._http.request(b"GET", address, b"/health", deadline=deadline)
        if status != 200:
            return f"/health answered {status}"
        now = self._clock()
        if not self._models_due(record, now):
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
