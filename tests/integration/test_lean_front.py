"""An API process's lean front over real sockets and a real Redis, as clients speak to it byte by byte:
pipelined calls are answered in order, ``Expect: 100-continue`` is honoured, what it cannot take is refused
with the right status and an OpenAI-style error (and the connection closed), and a call it passes on to a
controller that does not answer is a clear 503. (Every registry call through it, beside the controller's own
routes: ``test_registry_api.py``.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aioredis

from controller.api_processes import Forwarder
from controller.lean_front import MAX_BODY_BYTES, MAX_HEAD_BYTES, LeanFront
from controller.registry_api import RegistryApi
from poolgate.kernel.config import parse_config
from poolgate.kernel.fleet import WorkerRecord
from poolgate.kernel.store import FleetStore
from poolgate.procs import free_port

CONFIG = parse_config({"pools": [{"name": "chat", "model": "m1"}], "controller": {"heartbeat_ttl_s": 60}})
TOKEN = "front-token"
AUTH = b"Authorization: Bearer %s\r\n" % TOKEN.encode()


def counted(answer: dict[str, object]) -> dict[str, object]:
    """A batch answer without the pace it hands out (``heartbeat_interval_s``, ``heartbeat_ttl_s``)."""
    return {name: answer[name] for name in ("ok", "not_registered")}


@pytest.fixture()
async def front(redis_client: aioredis.Redis) -> AsyncIterator[int]:
    """The front's port; its controller (for calls passed on) is a port nobody listens on."""
    store = FleetStore(redis_client, "front")
    await store.register(WorkerRecord(id="w1", pool="chat", model="m1", host="127.0.0.1", port=9001), 60)
    registry = RegistryApi(store, TOKEN, CONFIG.pools, CONFIG.controller, CONFIG.autoscale.pools)
    forwarder = Forwarder(f"http://127.0.0.1:{free_port()}")
    server = await asyncio.get_running_loop().create_server(lambda: LeanFront(registry, forwarder), "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await forwarder.close()


def post(path: bytes, body: bytes, extra: bytes = AUTH) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s" % (path, extra, len(body), body)


async def answers(port: int, data: bytes, count: int = 1) -> tuple[list[tuple[int, dict[str, str], bytes]], bool]:
    """Send ``data``, read ``count`` answers; also whether the server closed the connection after them."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        read = [await read_answer(reader) for _ in range(count)]
        closed = await asyncio.wait_for(reader.read(1), 2) == b"" if read[-1][1].get("connection") == "close" \
            else False
        return read, closed
    finally:
        writer.close()


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = head.decode().split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split(" ")[1]), headers, body


async def test_pipelined_calls_are_answered_in_order(front: int) -> None:
    calls = (post(b"/v1/heartbeats", b'{"workers": [{"id": "w1"}, {"id": "gone"}]}')
             + post(b"/v1/workers/gone/heartbeat", b"") + post(b"/v1/workers/w1/heartbeat", b'{"running": 3}'))
    (first, second, third), _ = await answers(front, calls, 3)
    assert (first[0], counted(orjson.loads(first[2]))) == (200, {"ok": 1, "not_registered": ["gone"]})
    assert (second[0], orjson.loads(second[2])["error"]["code"]) == (404, "not_registered")
    assert (third[0], orjson.loads(third[2])["ok"]) == (200, True)


async def test_a_client_that_expects_100_continue_gets_it_before_it_sends_the_body(front: int) -> None:
    body = orjson.dumps({"workers": [{"id": "w1"}] + [{"id": f"gone{i}"} for i in range(99)]})
    reader, writer = await asyncio.open_connection("127.0.0.1", front)
    try:
        writer.write(b"POST /v1/heartbeats HTTP/1.1\r\nHost: x\r\n%sExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
                     % (AUTH, len(body)))
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body)
        status, _, answer = await read_answer(reader)
        gone = [f"gone{i}" for i in range(99)]
        assert (status, counted(orjson.loads(answer))) == (200, {"ok": 1, "not_registered": gone})
    finally:
        writer.close()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"POST /v1/heartbeats HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    (b"POST /v1/heartbeats HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1), 413),
    (b"POST /v1/heartbeats HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
    (b"POST /v1/heartbeats HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", 400),
    (b"GET /healthz HTTP/1.1\r\nX: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n", 431),
])
async def test_what_the_front_cannot_take_is_refused_and_the_connection_closed(front: int, request_bytes: bytes,
                                                                               status: int) -> None:
    [(answered, headers, body)], closed = await answers(front, request_bytes)
    assert answered == status and headers["content-type"] == "application/json"
    assert orjson.loads(body)["error"]["message"]
    assert closed


async def test_the_token_is_required_and_a_bad_body_is_a_clear_400(front: int) -> None:
    [(status, _, body)], _ = await answers(front, post(b"/v1/heartbeats", b'{"workers": []}', extra=b""))
    assert (status, orjson.loads(body)["error"]["code"]) == (401, "unauthorized")
    [(status, _, body)], _ = await answers(front, post(b"/v1/heartbeats", b'{"workers": [{"id": "w1"'))
    assert (status, orjson.loads(body)["error"]["code"]) == (400, "invalid_heartbeat")


async def test_http_1_0_and_connection_close_are_answered_then_closed(front: int) -> None:
    for version, extra in ((b"HTTP/1.0", b""), (b"HTTP/1.1", b"Connection: close\r\n")):
        [(status, headers, body)], closed = await answers(front, b"GET /healthz %s\r\n%s\r\n" % (version, extra))
        assert (status, body, headers["connection"], closed) == (200, b'{"status":"ok"}', "close", True)


async def test_a_call_passed_on_to_a_controller_that_does_not_answer_is_a_clear_503(front: int) -> None:
    [(status, _, body)], _ = await answers(front, b"GET /v1/workers HTTP/1.1\r\n%s\r\n" % AUTH)
    assert (status, orjson.loads(body)["error"]["code"]) == (503, "controller_unreachable")
