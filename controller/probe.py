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

import aiohttp
import orjson

from controller.health import ProbeResult
from poolgate.kernel.fleet import WorkerRecord

MODELS_RECHECK_S = 60.0
"""A worker whose ``/v1/models`` listed its model is asked again after this long (or once re-registered)."""
MAX_REMEMBERED = 25_000
"""Workers whose last good ``/v1/models`` is remembered at most (then the memory starts again)."""


MAX_HEAD_BYTES = 16 * 1024
"""A ``/health`` answer's status line and headers may be this long at most."""


class HealthClient:
    """``GET /health`` over one kept-alive connection per worker, with nothing but what a status needs.

    The monitor asks every worker every round (1,000 and more a second in a large fleet); a general HTTP
    client's per-request machinery cost ~5 times what the request itself does, which bounded how fast a large
    fleet could be probed and so how fast its dead workers left. A connection the worker closed meanwhile
    is opened again once.
    """

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self._tls = tls
        self._idle: dict[tuple[str, int, bool], tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def status(self, host: str, port: int, https: bool) -> int:
        address = (host, port, https)
        kept = self._idle.pop(address, None)
        if kept is not None:
            try:
                return await self._ask(address, *kept)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass  # closed by the worker while idle: ask on a new connection
        if https and self._tls is None:
            self._tls = ssl.create_default_context()  # once: building one loads the system's CAs
        reader, writer = await asyncio.open_connection(host, port, ssl=self._tls if https else None,
                                                       limit=MAX_HEAD_BYTES)
        return await self._ask(address, reader, writer)

    async def _ask(self, address: tuple[str, int, bool], reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> int:
        try:
            host = f"[{address[0]}]" if ":" in address[0] else address[0]
            writer.write(b"GET /health HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (host.encode(), address[1]))
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head[:-4].split(b"\r\n")
            status = int(status_line.split(b" ", 2)[1])
            headers = dict(line.lower().split(b":", 1) for line in header_lines if b":" in line)
            if b"chunked" in headers.get(b"transfer-encoding", b""):
                while size := int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16):
                    await reader.readexactly(size + 2)
                await reader.readuntil(b"\r\n")
            else:
                await reader.readexactly(int(headers.get(b"content-length", b"0")))
        except BaseException:
            writer.close()
            raise
        if b"close" in headers.get(b"connection", b"") or len(self._idle) >= MAX_REMEMBERED:
            writer.close()
        else:
            self._idle[address] = (reader, writer)
        return status

    def close(self) -> None:
        for _, writer in self._idle.values():
            writer.close()
        self._idle.clear()


class HttpProber:
    """Probes ``/health`` through a ``HealthClient`` and ``/v1/models`` through one shared session; each probe
    is bounded by ``timeout_s`` in total."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float, check_models: bool,
                 clock: Callable[[], float] = time.perf_counter, scheme: str = "http",
                 models_recheck_s: float = MODELS_RECHECK_S, tls: ssl.SSLContext | None = None) -> None:
        self._session = session
        self._health = HealthClient(tls)
        self._scheme = scheme
        self._timeout = timeout_s
        self._check_models = check_models
        self._clock = clock
        self._models_recheck_s = models_recheck_s
        self._models_seen: dict[str, tuple[float, float]] = {}
        """Worker id → (its ``registered_at``, when its ``/v1/models`` last listed its model)."""
        self.models_checks = 0

    def close(self) -> None:
        self._health.close()

    async def probe(self, record: WorkerRecord) -> ProbeResult:
        started = self._clock()
        try:
            async with asyncio.timeout(self._timeout):
                reason = await self._probe(record)
        except TimeoutError:
            reason = f"no answer within {self._timeout:g} s"
        except (aiohttp.ClientConnectorError, ConnectionRefusedError):
            reason = "connection refused"
        except (aiohttp.ClientError, OSError, ValueError, IndexError, asyncio.IncompleteReadError,
                asyncio.LimitOverrunError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        return ProbeResult(ok=not reason, latency_s=self._clock() - started, reason=reason)

    async def _probe(self, record: WorkerRecord) -> str:
        status = await self._health.status(record.host, record.port, self._scheme == "https")
        if status != 200:
            return f"/health answered {status}"
        base = f"{self._scheme}://{record.address}"
        if not self._check_models:
            return ""
        now = self._clock()
        seen = self._models_seen.get(record.id)
        if seen is not None and seen[0] == record.registered_at and now - seen[1] < self._models_recheck_s:
            return ""
        self._models_seen.pop(record.id, None)
        self.models_checks += 1
        async with self._session.get(f"{base}/v1/models") as response:
            body = await response.read()
            if response.status != 200:
                return f"/v1/models answered {response.status}"
        served = {card.get("id") for card in orjson.loads(body).get("data", []) if isinstance(card, dict)}
        if not served & set(record.names):
            return f"/v1/models does not list {record.names[0]!r}"
        if len(self._models_seen) >= MAX_REMEMBERED:
            self._models_seen.clear()  # workers long gone; everyone is simply asked once more
        self._models_seen[record.id] = (record.registered_at, now)
        return ""
