"""The fleet's HTTP client over real sockets: idle connections the peer closes are reported once, a client
nobody asks keeps only the latest of them, and a closed one is never reused."""

from __future__ import annotations

import asyncio

import pytest

from poolgate.kernel import lean_http
from poolgate.kernel.lean_http import LeanHttpClient

ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def _server_that_hangs_up_after_answering(handlers: set[asyncio.Task[None]]) -> asyncio.Server:
    """Answers a request, then closes the connection (a keep-alive timeout, or a worker that exited)."""

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(ANSWER)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.close()
        await writer.wait_closed()

    def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.create_task(answer(reader, writer))
        handlers.add(task)
        task.add_done_callback(handlers.discard)

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_a_client_nobody_asks_keeps_only_the_latest_lost_connections(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lean_http, "MAX_LOST_REPORTED", 2)
    handlers: set[asyncio.Task[None]] = set()
    servers = [await _server_that_hangs_up_after_answering(handlers) for _ in range(3)]
    addresses = [("127.0.0.1", server.sockets[0].getsockname()[1], False) for server in servers]
    client = LeanHttpClient()
    try:
        for address in addresses:
            assert await client.request(b"GET", address, b"/health") == (200, b"ok")
            await asyncio.sleep(0.2)  # this server has hung up before the next is asked
        assert client.closed_idle() == addresses[1:]  # the oldest loss was let go
        assert client.closed_idle() == []  # each loss is reported once
        # the first connection was lost too, though no longer listed: it is not reused
        assert await client.request(b"GET", addresses[0], b"/health") == (200, b"ok")
    finally:
        client.close()
        await asyncio.gather(*handlers, return_exceptions=True)
        for server in servers:
            server.close()
            await server.wait_closed()
