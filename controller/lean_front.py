"""The API processes' HTTP server: workers' calls (heartbeats, registrations) answered with nothing but what
they need, every other call passed on to the controller.

At 10,000 workers an API process answers 1,250 node heartbeats a second, and aiohttp's per-request machinery
(request and response objects, the router, middleware, the writer) took about half of its CPU: on a host
whose cores were all busy, a heartbeat waited 100-500 ms for its turn. Here each connection is an
``asyncio.Protocol`` that finds a request's head and body in its buffer, answers the calls it knows from
``RegistryApi``'s own methods (the same checks and answers as the controller's aiohttp routes), and hands the
rest (listing, deregistration, drain, scale, ``/metrics``) to the controller's API through ``pass_on``. HTTP/1.1
with ``Content-Length`` bodies only (a chunked body is answered 411), one request at a time per connection
(pipelined ones wait in order), keep-alive unless the client asks to close or speaks HTTP/1.0.
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections.abc import Awaitable, Callable

from controller.registry_api import HEALTHY, UNAUTHORIZED, Answer, RegistryApi, error_answer
from poolgate.kernel.errors import Refused

log = logging.getLogger("poolgate.controller.api")

MAX_HEAD_BYTES = 16 * 1024
"""A request's line and headers may be this long at most (431 past it)."""
MAX_BODY_BYTES = 64 * 1024
"""A request's body may be this large at most (413 past it), as the controller's own API allows."""

PassOn = Callable[[bytes, bytes, dict[bytes, bytes], bytes], Awaitable[tuple[int, dict[str, str], bytes]]]
"""(method, target, headers by lowercase name, body) → the controller's (status, headers, body)."""

_HEARTBEAT = b"/heartbeat"
_WORKERS = b"/v1/workers/"
_OPEN_PATHS = frozenset({b"/healthz"})
_PHRASES = {status.value: status.phrase.encode() for status in http.HTTPStatus}


class _Request:
    __slots__ = ("body", "close", "headers", "method", "target")

    def __init__(self, method: bytes, target: bytes, headers: dict[bytes, bytes], body: bytes, close: bool) -> None:
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.close = close


class BadRequest(Refused, ValueError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_request(buffer: bytearray) -> tuple[_Request, int] | None:
    """The request at the start of ``buffer`` and how many bytes it took; None while it is incomplete;
    ``BadRequest`` for what cannot be answered (the connection is closed after the answer)."""
    end = buffer.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
    if end < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise BadRequest(431, f"request head longer than {MAX_HEAD_BYTES} bytes")
        return None
    lines = bytes(buffer[:end]).split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1.") or not parts[1].startswith(b"/"):
        raise BadRequest(400, "not an HTTP/1.1 request line")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            raise BadRequest(400, "malformed header line")
        name = name.lower()
        if name in headers and name == b"content-length":
            raise BadRequest(400, "more than one Content-Length")
        headers[name] = value.strip()
    if b"transfer-encoding" in headers:
        raise BadRequest(411, "send the body with a Content-Length (chunked bodies are not accepted here)")
    length_text = headers.get(b"content-length", b"0")
    if not length_text.isdigit():
        raise BadRequest(400, "Content-Length is not a number")
    length = int(length_text)
    if length > MAX_BODY_BYTES:
        raise BadRequest(413, f"body of {length} bytes, more than the {MAX_BODY_BYTES} accepted")
    start = end + 4
    if len(buffer) < start + length:
        return None
    connection = headers.get(b"connection", b"").lower()
    close = b"close" in connection or parts[2] == b"HTTP/1.0"  # 1.0 keep-alive needs a header back: not worth it
    return _Request(parts[0], parts[1], headers, bytes(buffer[start:start + length]), close), start + length


def encode_answer(status: int, body: bytes, close: bool, content_type: str = "application/json",
                  retry_after: int | None = None) -> bytes:
    head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
        status, _PHRASES.get(status, b"Unknown"), content_type.encode("latin-1"), len(body))
    if retry_after is not None:
        head += b"Retry-After: %d\r\n" % retry_after
    if close:
        head += b"Connection: close\r\n"
    return head + b"\r\n" + body


class LeanFront(asyncio.Protocol):
    """One client connection of an API process."""

    def __init__(self, registry: RegistryApi, pass_on: PassOn,
                 on_lost: Callable[[LeanFront], None] = lambda _: None) -> None:
        self._registry = registry
        self._pass_on = pass_on
        self._on_lost = on_lost
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self.busy = False
        """A request is being answered: the next waits in the buffer."""
        self._paused = False
        self._continued = False
        """``100 Continue`` was sent for the request whose body is awaited."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's transports do not subclass asyncio's

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None  # an answer under way is finished and dropped (a heartbeat written stays written)
        self._on_lost(self)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self.busy:
            if len(self._buffer) > MAX_HEAD_BYTES + MAX_BODY_BYTES and self._transport is not None:
                self._paused = True  # a client that sends on without reading its answers waits
                self._transport.pause_reading()
            return
        self._next()

    def _next(self) -> None:
        """Answer the next complete request in the buffer, if there is one."""
        try:
            parsed = parse_request(self._buffer)
        except BadRequest as exc:
            self._send(error_answer(exc.status, str(exc), "invalid_request"), close=True)
            return
        if parsed is None:
            self._continue_if_asked()
            return
        request, used = parsed
        del self._buffer[:used]
        self.busy = True
        self._continued = False
        task = asyncio.get_running_loop().create_task(self._answer(request))
        task.add_done_callback(lambda done: self._answered(done, request))

    def _continue_if_asked(self) -> None:
        """A client that sent ``Expect: 100-continue`` waits for this before it sends the body (curl does, for
        bodies past 1 KiB: a node's batch of 100 workers)."""
        end = self._buffer.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
        if (end >= 0 and not self._continued and self._transport is not None
                and b"\r\nexpect: 100-continue" in bytes(self._buffer[:end]).lower()):
            self._continued = True
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _answered(self, done: asyncio.Task[Answer | bytes], request: _Request) -> None:
        if done.cancelled():
            self.close()
            return
        if (error := done.exception()) is not None:
            log.warning("API call %s %s failed: %r", request.method.decode(errors="replace"),
                        request.target.decode(errors="replace"), error)
            self._send(error_answer(500, "the registry failed to answer; try again", "internal_error"), close=True)
            return
        answer = done.result()
        if isinstance(answer, bytes):  # passed on: already encoded
            self._write(answer, request.close)
        else:
            self._send(answer, request.close)

    def _send(self, answer: Answer, close: bool) -> None:
        self._write(encode_answer(answer.status, answer.body, close, retry_after=answer.retry_after), close)

    def _write(self, data: bytes, close: bool) -> None:
        self.busy = False
        if self._transport is None:
            return
        self._transport.write(data)
        if close:
            self.close()
            return
        if self._paused:
            self._paused = False
            self._transport.resume_reading()
        if self._buffer:
            self._next()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    async def _answer(self, request: _Request) -> Answer | bytes:
        path = request.target.partition(b"?")[0]
        if request.method == b"GET" and path in _OPEN_PATHS:
            return HEALTHY
        worker_call = request.method == b"POST" and (
            path in (b"/v1/heartbeats", b"/v1/workers")
            or (path.startswith(_WORKERS) and path.endswith(_HEARTBEAT) and path.count(b"/") == 4))
        if not worker_call:
            status, headers, body = await self._pass_on(request.method, request.target, request.headers,
                                                        request.body)
            retry_after = headers.get("Retry-After")
            return encode_answer(status, body, request.close, headers.get("Content-Type", "application/json"),
                                 int(retry_after) if retry_after and retry_after.isdigit() else None)
        if not self._registry.authorized(request.headers.get(b"authorization", b"").decode("latin-1")):
            return UNAUTHORIZED
        if path == b"/v1/heartbeats":
            return await self._registry.heartbeat_batch(request.body)
        if path == b"/v1/workers":
            return await self._registry.register(request.body)
        return await self._registry.heartbeat(path[len(_WORKERS):-len(_HEARTBEAT)].decode("latin-1"), request.body)
