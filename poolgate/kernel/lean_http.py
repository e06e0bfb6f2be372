"""HTTP/1.1 requests over one kept-alive connection per address, with nothing but what a status and a small
body need.

Used where one process talks to a whole fleet many times a second: the health monitor asks every worker
every round, and the scale benchmark plays every node agent's heartbeats. A general HTTP client's
per-request machinery cost ~5 times what the request itself does, which bounded how fast a large fleet
could be probed (and how many heartbeats one process could send). Each connection is an
``asyncio.Protocol`` that parses the answer as its bytes arrive: no stream reader and writer per
connection, no timeout scope per request (the health monitor spent 139 µs of CPU per probe of 10,000
workers with streams, 100 with this; ``poolgate bench health_rounds``), and a deadline is a coarse timer
(``poolgate.kernel.coarse_timers``), not a loop timer. A connection the peer closed while
idle is opened again once; the answer must fit in ``max_body`` bytes. ``ask_kept`` asks on a kept-alive
connection with no coroutine at all, the answer handed to a callback (a task and a chain of coroutines per probe
cost the monitor a third of its CPU at 10,000 workers). ``closed_idle`` names the addresses
whose idle connection the peer closed since (a worker process that exited closes them at once; so does a
server's keep-alive timeout): each connection reports its own loss, so the call costs what closed, not what
is open (looking at all 10,000 every 0.25 s took 6 % of the monitor's CPU).
"""

from __future__ import annotations

import asyncio
import functools
import ssl
from collections import deque
from collections.abc import Callable
from typing import cast

from poolgate.kernel.coarse_timers import CoarseTimer, coarse_timers
from poolgate.kernel.errors import UpstreamError

MAX_HEAD_BYTES = 16 * 1024
"""An answer's status line and headers may be this long at most."""
MAX_IDLE = 25_000
"""Idle connections kept at most (one per worker or node; past that a connection is closed after use)."""
MAX_LOST_REPORTED = MAX_IDLE
"""Idle connections lost and not yet collected by ``closed_idle`` that are remembered at most (a client whose
owner never asks, such as a heartbeat sender, keeps the latest only; a reused connection is checked anyway)."""

MAX_KEPT_REQUESTS = 8
"""Encoded requests a connection keeps at most (``ask_kept``: a prober asks one, a node agent one per workers set)."""

Address = tuple[str, int, bool]
"""(host, port, https)."""
Answer = tuple[int, bytes, bool]
"""(status, body, whether the server keeps the connection open)."""
Reply = Callable[[Answer | BaseException], None]
"""Told a request's answer, or why there is none, once (``_Connection.ask``)."""


class AnswerTooLarge(UpstreamError, ValueError):
    """The answer's body was larger than the caller accepts."""


class PeerClosed(UpstreamError, ConnectionResetError):
    """The peer closed the connection before the whole answer came."""


def parse_answer(buffer: bytes | bytearray, max_body: int) -> tuple[Answer, int] | None:
    """The answer at the start of ``buffer`` and how many bytes it took, or None while it is incomplete;
    ``ValueError`` for bytes that are not an HTTP answer, ``AnswerTooLarge`` past ``max_body``."""
    end = buffer.find(b"\r\n\r\n", 0, MAX_HEAD_BYTES + 4)
    if end < 0:
        if len(buffer) > MAX_HEAD_BYTES:
            raise ValueError(f"answer head longer than {MAX_HEAD_BYTES} bytes")
        return None
    head = bytes(buffer[:end]).lower()  # one pass; the few headers needed are found in it, not split out
    parts = head.split(b"\r\n", 1)[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"http/"):
        raise ValueError(f"not an HTTP answer: {bytes(buffer[:80])!r}")
    status = int(parts[1])
    keep_alive = b"close" not in header_value(head, b"connection")
    start = end + 4
    if b"chunked" not in header_value(head, b"transfer-encoding"):
        length = int(header_value(head, b"content-length") or b"0")
        if length > max_body:
            raise AnswerTooLarge(f"answer of {length} bytes, more than the {max_body} accepted")
        if len(buffer) < start + length:
            return None
        return (status, bytes(buffer[start:start + length]), keep_alive), start + length
    chunks, at, size = [], start, -1
    while size:
        line_end = buffer.find(b"\r\n", at)
        if line_end < 0:
            return None
        size = int(bytes(buffer[at:line_end]).strip().split(b";")[0], 16)
        max_body -= size
        if max_body < 0:
            raise AnswerTooLarge("answer larger than accepted")
        if len(buffer) < line_end + 2 + size + 2:
            return None
        chunks.append(bytes(buffer[line_end + 2:line_end + 2 + size]))
        at = line_end + 2 + size + 2
    return (status, b"".join(chunks), keep_alive), at


def header_value(head: bytes, name: bytes) -> bytes:
    """The value of header ``name`` (lowercase) in a lowercased HTTP head (empty when absent)."""
    at = head.find(b"\r\n" + name + b":")
    if at < 0:
        return b""
    start = at + len(name) + 3
    end = head.find(b"\r\n", start)
    return head[start:end if end >= 0 else len(head)].strip()


class _Connection(asyncio.Protocol):
    """One connection: at most one request in flight, its answer parsed as the bytes arrive."""

    def __init__(self, address: Address, on_idle_loss: deque[_Connection]) -> None:
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.idle = False
        self._on_idle_loss = on_idle_loss
        self._buffer = bytearray()
        self.requests: dict[tuple[bytes, bytes, bytes], bytes] = {}
        """(method, path, body) → the request asked on this connection (``ask_kept``), encoded once."""
        self._reply: Reply | None = None
        self._max_body = 0
        self._timer: CoarseTimer | None = None
        self._timers = coarse_timers()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def ask(self, request: bytes, max_body: int, deadline: float | None, reply: Reply) -> None:
        """Send ``request``; ``reply`` is told its answer as it is parsed, or ``TimeoutError`` once the loop's
        clock passes ``deadline`` (a coarse timer, cheaper than a timeout scope or a loop timer: this runs once per
        probe of the whole fleet, and the answer nearly always comes first)."""
        assert self.transport is not None
        self._buffer.clear()
        self._max_body = max_body
        self._reply = reply
        if deadline is not None:
            self._timer = self._timers.call_at(deadline, self._time_out)
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        if self._reply is None:
            self.close()  # bytes nobody asked for: the connection's state is unknown
            return
        self._buffer += data
        try:
            parsed = parse_answer(self._buffer, self._max_body)
        except ValueError as exc:
            self._settle(exc)
            return
        if parsed is not None:
            self._buffer.clear()
            self._settle(parsed[0])

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._reply is not None:
            self._settle(PeerClosed(f"connection closed before the answer ({exc or 'by the peer'})"))
        elif self.idle:
            self._on_idle_loss.append(self)

    def _time_out(self) -> None:
        self._timer = None
        self._settle(TimeoutError("no answer in time"))

    def _settle(self, outcome: Answer | BaseException) -> None:
        """The request in flight is answered (or failed: the connection is closed, its state unknown)."""
        reply, self._reply = self._reply, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if reply is None:
            return
        if isinstance(outcome, BaseException):
            self.close()
        reply(outcome)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class LeanHttpClient:
    """``request`` sends one request on the address's idle connection (or a new one) and reads the answer."""

    def __init__(self, tls: ssl.SSLContext | None = None, headers: bytes = b"") -> None:
        self._tls = tls
        self._headers = headers
        """Extra header lines sent with every request, each ending in CRLF (e.g. an Authorization line)."""
        self._idle: dict[Address, _Connection] = {}
        self._lost_idle: deque[_Connection] = deque(maxlen=MAX_LOST_REPORTED)
        """Idle connections the peer closed since ``closed_idle`` last looked (each reports its own loss)."""

    async def request(self, method: bytes, address: Address, path: bytes, body: bytes = b"",
                      max_body: int = 64 * 1024, deadline: float | None = None) -> tuple[int, bytes]:
        """The answer's status and body; raises ``OSError`` when the peer cannot be reached or hangs up,
        ``ValueError`` for an answer that is not HTTP or too large, ``TimeoutError`` once the running loop's
        clock (``loop.time()``) passes ``deadline``."""
        request = self._encode(method, address, path, body)
        kept = self._idle.pop(address, None)
        if kept is not None:
            kept.idle = False
            if not kept.lost:
                try:
                    return await self._exchange(kept, request, max_body, deadline)
                except PeerClosed:
                    pass  # closed by the peer while idle (its close crossed our request): ask on a new one
        return await self._exchange(await self._connect(address, deadline), request, max_body, deadline)

    async def _connect(self, address: Address, deadline: float | None) -> _Connection:
        https = address[2]
        if https and self._tls is None:
            self._tls = ssl.create_default_context()  # once: building one loads the system's CAs
        loop = asyncio.get_running_loop()
        async with asyncio.timeout_at(deadline):
            _, connection = await loop.create_connection(lambda: _Connection(address, self._lost_idle), address[0],
                                                         address[1], ssl=self._tls if https else None)
        return connection

    def _encode(self, method: bytes, address: Address, path: bytes, body: bytes) -> bytes:
        host = f"[{address[0]}]" if ":" in address[0] else address[0]
        head = b"%s %s HTTP/1.1\r\nHost: %s:%d\r\n%s" % (method, path, host.encode(), address[1], self._headers)
        if body or method not in (b"GET", b"HEAD"):
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        return head + b"\r\n" + body

    def ask_kept(self, method: bytes, address: Address, path: bytes, deadline: float | None,
                 reply: Callable[[tuple[int, bytes] | BaseException], None], body: bytes = b"",
                 max_body: int = 64 * 1024) -> bool:
        """Send the request on the address's kept-alive connection and return True; ``reply`` is told the
        answer's status and body, or the error ``request`` would raise (``PeerClosed`` where the peer closed the
        connection as it was asked: ``request`` would then ask on a new one), from within the loop's callback
        that parsed it. False, and nothing sent, where no connection to it is kept. A request asked again on the
        same connection (the same method, path and body) is not encoded again."""
        kept = self._idle.pop(address, None)
        if kept is None:
            return False
        kept.idle = False
        if kept.lost:
            return False
        request = kept.requests.get((method, path, body))
        if request is None:
            if len(kept.requests) >= MAX_KEPT_REQUESTS:
                kept.requests.clear()
            request = kept.requests[(method, path, body)] = self._encode(method, address, path, body)
        kept.ask(request, max_body, deadline, functools.partial(self._kept_answered, kept, reply))
        return True

    def _kept_answered(self, connection: _Connection, reply: Callable[[tuple[int, bytes] | BaseException], None],
                       outcome: Answer | BaseException) -> None:
        if isinstance(outcome, BaseException):
            reply(outcome)
            return
        status, answer, keep_alive = outcome
        self._keep(connection, keep_alive)
        reply((status, answer))

    async def _exchange(self, connection: _Connection, request: bytes, max_body: int,
                        deadline: float | None) -> tuple[int, bytes]:
        answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        connection.ask(request, max_body, deadline, functools.partial(_resolve, answer))
        try:
            status, body, keep_alive = await answer
        except BaseException:  # an error, or the caller's timeout: the connection's state is unknown
            connection.close()
            raise
        self._keep(connection, keep_alive)
        return status, body

    def _keep(self, connection: _Connection, keep_alive: bool) -> None:
        """An answered connection goes back to the idle ones, or is closed."""
        address = connection.address
        if not keep_alive or connection.lost or len(self._idle) >= MAX_IDLE or address in self._idle:
            connection.close()  # (a request at the same time opened another: keep one)
        else:
            connection.idle = True
            self._idle[address] = connection

    def closed_idle(self) -> list[Address]:
        """The addresses whose idle connection the peer closed since the last call (those connections dropped)."""
        lost = list(self._lost_idle)
        self._lost_idle.clear()
        closed = []
        for connection in lost:
            if self._idle.get(connection.address) is connection:
                del self._idle[connection.address]
                closed.append(connection.address)
        return closed

    def close(self) -> None:
        for connection in self._idle.values():
            connection.idle = False
            connection.close()
        self._idle.clear()


def _resolve(future: asyncio.Future[Answer], outcome: Answer | BaseException) -> None:
    if future.done():  # the caller stopped waiting
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
