"""Every fake worker of a scale benchmark behind one port: whatever loopback address a request came to, it
answers as an idle, healthy vLLM worker serving the bench models (``/health``, ``/v1/models``, ``/metrics``,
``/v1/completions``); with ``fail_requests`` every completion is a 500 while its probes still pass.

The fleet's workers stand for machines of their own, but here they share the benchmark's two cores with the
stack they are measured against: a general web framework spent ~100 µs of CPU per probe answered (at 8,000
probes a second, half a core taken from the controller). This server answers from an ``asyncio.Protocol``
with canned bytes, a few µs each.
"""

from __future__ import annotations

import asyncio

import orjson
import uvloop

from poolgate.kernel.heap import freeze_startup_objects
from poolgate.kernel.lean_http import header_value

MAX_REQUEST_BYTES = 1024 * 1024
"""A request larger than this closes its connection (none of the bench's clients sends one)."""


def _answer(status: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (status, content_type, len(body),
                                                                                 body)


def answers(models: list[str], fail_requests: bool) -> dict[bytes, bytes]:
    """Request line start (method and path) → the whole answer."""
    listing = orjson.dumps({"object": "list", "data": [{"id": name, "object": "model"} for name in models]})
    metrics = b"".join(b'vllm:%s{model_name="%s"} 0\n' % (name, models[0].encode())
                       for name in (b"num_requests_running", b"num_requests_waiting", b"kv_cache_usage_perc"))
    completion = orjson.dumps({"object": "text_completion",
                               "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})
    failure = orjson.dumps({"error": {"message": "engine failed", "type": "server_error"}})
    return {b"GET /health": _answer(b"200 OK", b""),
            b"GET /v1/models": _answer(b"200 OK", listing),
            b"GET /metrics": _answer(b"200 OK", metrics, b"text/plain"),
            b"POST /v1/completions": _answer(b"500 Internal Server Error", failure) if fail_requests
            else _answer(b"200 OK", completion)}


NOT_FOUND = _answer(b"404 Not Found", b'{"error": {"message": "not found", "type": "not_found"}}')


class _FakeWorker(asyncio.Protocol):
    """One client connection: each complete request (head and ``Content-Length`` body) gets its answer."""

    def __init__(self, canned: dict[bytes, bytes]) -> None:
        self._canned = canned
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # a stream transport

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            head = bytes(self._buffer[:end])
            length = int(header_value(head.lower(), b"content-length") or b"0")
            if len(self._buffer) < end + 4 + length:
                break
            method, path = head.split(b" ", 2)[:2]
            del self._buffer[:end + 4 + length]
            self._transport.write(self._canned.get(method + b" " + path.split(b"?")[0], NOT_FOUND))
        if len(self._buffer) > MAX_REQUEST_BYTES:
            self._transport.close()


def serve(port: int, models: list[str], fail_requests: bool = False) -> None:
    """Serve on every address at ``port`` until the process is stopped."""
    canned = answers(models, fail_requests)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _FakeWorker(canned), "0.0.0.0", port, backlog=4096)
        freeze_startup_objects()
        async with server:
            await server.serve_forever()

    uvloop.run(main())
