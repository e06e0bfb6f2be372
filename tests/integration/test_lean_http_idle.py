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


async def test_a_server_that_never_answers_times_out_at_the_deadline_and_its_connection_is_dropped() -> None:
    """The deadline is a coarse timer (``poolgate.kernel.coarse_timers``): it fires within a tick or so."""
    connections: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append((reader, writer))  # answers nothing: a hung engine

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    address = ("127.0.0.1", server.sockets[0].getsockname()[1], False)
    client = LeanHttpClient()
    loop = asyncio.get_running_loop()
    try:
        asked = loop.time()
        with pytest.raises(TimeoutError):
            await client.request(b"GET", address, b"/health", deadline=asked + 0.2)
        waited = loop.time() - asked
        print(f"timed out after {waited:.3f} s (deadline 0.200 s)")
        assert 0.2 <= waited < 1.0
        reader, _ = connections[0]
        # the request, then the end of the stream: the client closed the connection (its state is unknown)
        request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % address[1]
        assert await asyncio.wait_for(reader.read(), 5) == request
    finally:
        client.close()
        server.close()
        for _, writer in connections:
            writer.close()
        await server.wait_closed()
