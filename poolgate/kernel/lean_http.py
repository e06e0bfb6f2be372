"""HTTP/1.1 requests over one kept-alive connection per address, with nothing but what a status and a small
body need.

Used where one process talks to a whole fleet many times a second: the health monitor asks every worker
every round, and the scale benchmark plays every node agent's heartbeats. A general HTTP client's
per-request machinery cost ~5 times what the request itself does, which bounded how fast a large fleet
could be probed (and how many heartbeats one process could send). A connection the peer closed while idle
is opened again once; the answer must fit in ``max_body`` bytes. ``closed_idle`` names the addresses whose
idle connection the peer closed since (a worker process that exited closes them at once; so does a server's
keep-alive timeout).
"""

from __future__ import annotations

import asyncio
import ssl

MAX_HEAD_BYTES = 16 * 1024
"""An answer's status line and headers may be this long at most."""
MAX_IDLE = 25_000
"""Idle connections kept at most (one per worker or node; past that a connection is closed after use)."""

Address = tuple[str, int, bool]
"""(host, port, https)."""


class AnswerTooLarge(ValueError):
    """The answer's body was larger than the caller accepts."""


class LeanHttpClient:
    """``request`` sends one request on the address's idle connection (or a new one) and reads the answer."""

    def __init__(self, tls: ssl.SSLContext | None = None, headers: bytes = b"") -> None:
        self._tls = tls
        self._headers = headers
        """Extra header lines sent with every request, each ending in CRLF (e.g. an Authorization line)."""
        self._idle: dict[Address, tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}

    async def request(self, method: bytes, address: Address, path: bytes, body: bytes = b"",
                      max_body: int = 64 * 1024) -> tuple[int, bytes]:
        """The answer's status and body; raises ``OSError``/``asyncio.IncompleteReadError`` when the peer
        cannot be reached or hangs up, ``ValueError`` for an answer that is not HTTP or too large."""
        request = self._encode(method, address, path, body)
        kept = self._idle.pop(address, None)
        if kept is not None:
            try:
                return await self._exchange(address, request, max_body, *kept)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass  # closed by the peer while idle: ask on a new connection
        https = address[2]
        if https and self._tls is None:
            self._tls = ssl.create_default_context()  # once: building one loads the system's CAs
        reader, writer = await asyncio.open_connection(address[0], address[1], ssl=self._tls if https else None,
                                                       limit=MAX_HEAD_BYTES)
        return await self._exchange(address, request, max_body, reader, writer)

    def _encode(self, method: bytes, address: Address, path: bytes, body: bytes) -> bytes:
        host = f"[{address[0]}]" if ":" in address[0] else address[0]
        head = b"%s %s HTTP/1.1\r\nHost: %s:%d\r\n%s" % (method, path, host.encode(), address[1], self._headers)
        if body or method not in (b"GET", b"HEAD"):
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        return head + b"\r\n" + body

    async def _exchange(self, address: Address, request: bytes, max_body: int, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> tuple[int, bytes]:
        try:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head[:-4].split(b"\r\n")
            status = int(status_line.split(b" ", 2)[1])
            headers = dict(line.lower().split(b":", 1) for line in header_lines if b":" in line)
            if b"chunked" in headers.get(b"transfer-encoding", b""):
                parts = []
                while size := int((await reader.readuntil(b"\r\n")).strip().split(b";")[0], 16):
                    max_body -= size
                    if max_body < 0:
                        raise AnswerTooLarge("answer larger than accepted")
                    parts.append((await reader.readexactly(size + 2))[:-2])
                await reader.readuntil(b"\r\n")
                answer = b"".join(parts)
            else:
                length = int(headers.get(b"content-length", b"0"))
                if length > max_body:
                    raise AnswerTooLarge(f"answer of {length} bytes, more than the {max_body} accepted")
                answer = await reader.readexactly(length)
        except BaseException:
            writer.close()
            raise
        if (b"close" in headers.get(b"connection", b"") or len(self._idle) >= MAX_IDLE
                or address in self._idle):  # a request at the same time opened another: keep one
            writer.close()
        else:
            self._idle[address] = (reader, writer)
        return status, answer

    def closed_idle(self) -> list[Address]:
        """The addresses whose idle connection the peer closed since the last call (those connections dropped).
        One look at each idle connection's state, no I/O: ~0.1 µs a connection."""
        closed = [address for address, (reader, writer) in self._idle.items()
                  if reader.at_eof() or writer.is_closing()]
        for address in closed:
            self._idle.pop(address)[1].close()
        return closed

    def close(self) -> None:
        for _, writer in self._idle.values():
            writer.close()
        self._idle.clear()
